"""The assembler behind ``chunk`` spans: a request's approximate KV from stored chunk-caches.

A request whose ``craft_approx`` spans are all ``chunk`` spans (:mod:`.approx_params`) gets
K/V for ``[0, A)`` (``A``: the last span's end) built by :meth:`BlendAssembler.assemble`:

1. **head** ``[0, h)`` (everything before the first chunk): exact K/V from the model copy's
   own prefill, kept in the chunk-cache store under the head's tokens, so a repeated system
   prompt is computed once;
2. **chunks**: for each, the stored variant (:class:`~craft_rag.chunkcache.ChunkKV`: its K/V
   as computed in an earlier context) whose old prior chunks best match the new ones
   (Cache-Craft's adjusted prefix overlap ``beta'``), moved to its new position (RoPE keys
   re-rotated); a chunk without a stored variant gets a placeholder and is recomputed in full;
3. **selection**: per cached chunk, ``ceil(fraction x |C|)`` tokens (or Cache-Craft's CFO
   count for ``alpha``) ranked by the request's rule (``kv_deviation`` by default, ``cci``,
   ``random``: :mod:`craft_rag.chunkcache.selection`); every token of a chunk without a cache;
   none of a read-back variant (:meth:`BlendAssembler.keep_read_back`: the engine's exact K/V)
   used at its own position after the same head and chunks (it is exact there);
4. **recomputation**: :func:`craft_rag.chunkcache.blend_prefill` runs every layer for the
   selected tokens against the assembled context (their new K/V replace the cached ones);
5. **store**: each chunk that had no cache is stored as a new variant (its K/V in this
   context, CCI and per-token outside attention taken from the same pass, no extra forward).

So the K/V equals ``blend_prefill`` over the same variants with the same selection (tested on
the real model), and with every chunk new it is a full prefill of ``[0, A)``.

The store (:class:`ChunkCacheStore`) is in memory, per connector, bounded in bytes (least
recently used entry evicted first) with at most ``variants`` variants per chunk, and keyed by
(model, tenant salt, segment tokens): tenants never share chunk-caches, as they never share
tier blocks.

Counts over ``[start, A)`` (:meth:`BlendResult.counts`): *exact* (head tokens from the head
cache, chunks exact in place), *fixed* (cached chunk tokens not recomputed), *recomputed*
(selected tokens, chunks without a cache, a head computed now).

Cost of one request: the head prefill when not cached (O(h^2)); moving keys, O(A x kv size);
the ranker (``kv_deviation``: two layers for every chunk token); and ``blend_prefill`` for
``n_sel`` tokens, O(L x (n_sel x A x hidden + n_sel x layer parameters)); all on the
scheduler's thread. Memory: the store's bound plus one request's K/V.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from craft_rag.chunkcache.blend import assemble, blend_prefill, full_prefill
from craft_rag.chunkcache.layers import LayerKV, empty_kv
from craft_rag.chunkcache.selection import (
    RankInput,
    Selection,
    beta_prime,
    cfo_counts,
    fixed_counts,
    get_ranker,
    select_top,
)
from craft_rag.chunkcache.variants import (
    ChunkKV,
    ContextHash,
    SegmentHash,
    context_hash,
    context_impact,
    segment_hash,
)
from craft_rag.kvtiers.approx_params import BlendParams
from craft_rag.kvtiers.kv_sources import LayerKV as RowsKV
from craft_rag.kvtiers.kv_sources import LazyModel

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_CHUNK_CACHE_BYTES",
    "DEFAULT_VARIANTS",
    "BlendAssembler",
    "BlendResult",
    "CacheKey",
    "ChunkCacheStore",
]

DEFAULT_CHUNK_CACHE_BYTES = 256 << 20
DEFAULT_VARIANTS = 2


def kv_bytes(kv: LayerKV) -> int:
    """Bytes held by ``kv``'s keys and values."""
    return sum(t.numel() * t.element_size() for t in (*kv.keys, *kv.values))


@dataclass(frozen=True, slots=True)
class CacheKey:
    """Names a head or a chunk in the store: its kind, the model, the tenant salt (``""`` for
    none) and the hash of its tokens."""

    kind: str  # "head" | "chunk"
    model_id: str
    salt: str
    segment: SegmentHash


class ChunkCacheStore:
    """Heads (exact K/V from position 0) and chunk variants in memory, bounded by
    ``capacity_bytes`` over all entries (an entry is a head or all variants of one chunk; the
    least recently used goes first; one larger than the bound is not kept) and by
    ``variants`` per chunk (newest first; a variant of the same context replaces the old one).
    Single-threaded (the scheduler role). ``ValueError`` for a negative bound or
    ``variants < 1``."""

    def __init__(self, capacity_bytes: int = DEFAULT_CHUNK_CACHE_BYTES,
                 variants: int = DEFAULT_VARIANTS) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) \
                or capacity_bytes < 0:
            msg = f"chunk_cache_bytes must be a non-negative integer, got {capacity_bytes!r}"
            raise ValueError(msg)
        if isinstance(variants, bool) or not isinstance(variants, int) or variants < 1:
            msg = f"chunk_cache_variants must be an integer >= 1, got {variants!r}"
            raise ValueError(msg)
        self.capacity_bytes = capacity_bytes
        self.max_variants = variants
        self._heads: dict[CacheKey, LayerKV] = {}
        self._chunks: dict[CacheKey, list[ChunkKV]] = {}
        self._sizes: OrderedDict[CacheKey, int] = OrderedDict()
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._sizes)

    def head(self, key: CacheKey) -> LayerKV | None:
        kv = self._heads.get(key)
        if kv is not None:
            self._sizes.move_to_end(key)
        return kv

    def variants(self, key: CacheKey) -> tuple[ChunkKV, ...]:
        found = self._chunks.get(key)
        if not found:
            return ()
        self._sizes.move_to_end(key)
        return tuple(found)

    def best_variant(self, key: CacheKey, new_prior: Sequence[SegmentHash], *,
                     measured_only: bool = False) -> ChunkKV | None:
        """The variant whose old prior chunks best match ``new_prior`` (highest ``beta'``;
        ties: the newest), or ``None``; ``measured_only``: only variants with measured
        attention statistics (``ChunkKV.measured``). O(variants x m^2)."""
        found = self.variants(key)
        if measured_only:
            found = tuple(v for v in found if v.measured)
        if not found:
            return None
        return max(found, key=lambda v: beta_prime(v, new_prior))  # max keeps the first tie

    def put_head(self, key: CacheKey, kv: LayerKV) -> bool:
        """Keep ``kv``; False when it is larger than the whole store."""
        self._drop(key)
        if not self._admit(key, kv_bytes(kv)):
            return False
        self._heads[key] = kv
        return True

    def put_variant(self, key: CacheKey, variant: ChunkKV) -> bool:
        """Add ``variant`` as the newest of its chunk's variants (replacing one of the same
        context, dropping the oldest beyond ``variants``); False when it does not fit."""
        old = [v for v in self._chunks.get(key, []) if v.context != variant.context]
        kept = [variant, *old][: self.max_variants]
        self._drop(key)
        if not self._admit(key, sum(kv_bytes(v.kv) for v in kept)):
            return False
        self._chunks[key] = kept
        return True

    def _drop(self, key: CacheKey) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size
        self._heads.pop(key, None)
        self._chunks.pop(key, None)

    def _admit(self, key: CacheKey, size: int) -> bool:
        if size > self.capacity_bytes:
            return False
        while self.used_bytes + size > self.capacity_bytes:
            self._drop(next(iter(self._sizes)))
        self._sizes[key] = size
        self.used_bytes += size
        return True


@dataclass(frozen=True, slots=True)
class BlendResult:
    """One request's assembled K/V of ``[0, end)`` (HF layout, positions ``0..end-1``), the
    chunks' ``[start, end)`` spans, the recomputed selection (per chunk, relative indices),
    whether the head came from the head cache and which chunks had no cache."""

    kv: LayerKV
    head_end: int
    spans: tuple[tuple[int, int], ...]
    selection: Selection
    head_cached: bool
    missing: tuple[bool, ...]
    in_place: tuple[bool, ...] = ()  # per chunk: a read-back variant exact where it is

    @property
    def end(self) -> int:
        return self.kv.num_tokens

    def counts(self, start: int) -> tuple[int, int, int]:
        """(exact, fixed, recomputed) tokens of ``[start, end)``. O(end - start)."""
        head = max(0, self.head_end - start)
        exact = head if self.head_cached else 0
        recomputed = head - exact
        fixed = 0
        in_place = self.in_place or (False,) * len(self.spans)
        for (s, e), picked, here in zip(self.spans, self.selection.per_chunk, in_place,
                                        strict=True):
            first = max(s, start) - s
            if first >= e - s:
                continue
            if here:  # the engine's exact K/V where it was computed
                exact += e - s - first
                continue
            chosen = sum(1 for i in picked if i >= first)
            recomputed += chosen
            fixed += e - s - first - chosen
        return exact, fixed, recomputed

    def rows(self, start: int) -> RowsKV:
        """K/V of ``[start, end)`` as the connector writes it: ``[tokens, kv_heads, head]``
        per layer (copies)."""
        return ([k[:, start:].transpose(0, 1).contiguous() for k in self.kv.keys],
                [v[:, start:].transpose(0, 1).contiguous() for v in self.kv.values])


class _Stats:
    """Attention sums of one chunk without a cache while it is recomputed in full."""

    def __init__(self, n: int, priors: int, device: Any) -> None:
        import torch

        self.per_token = torch.zeros(n, device=device)
        self.inter = [0.0] * priors
        self.head = 0.0
        self.intra = 0.0


class BlendAssembler:
    """Builds a request's K/V from chunk-caches (module docstring). ``model``: the shared
    transformers copy of the served model (loaded on first use); ``store``: where heads and
    variants live (a new bounded one by default)."""

    def __init__(self, model_dir: str, model: LazyModel | None = None,
                 store: ChunkCacheStore | None = None) -> None:
        self.model_id = model_dir
        self._model = model or LazyModel(model_dir)
        self.store = store if store is not None else ChunkCacheStore()

    def key(self, kind: str, token_ids: Sequence[int], salt: str | None) -> CacheKey:
        return CacheKey(kind, self.model_id, salt or "", segment_hash(self.model_id, token_ids))

    def assemble(self, token_ids: Sequence[int], spans: Sequence[tuple[int, int]],
                 params: BlendParams, salt: str | None, *, seed: int = 0) -> BlendResult:
        """K/V of ``token_ids[:spans[-1][1]]`` with the chunks at ``spans`` (non-empty,
        contiguous, inside the prompt; ``ValueError`` otherwise) served from the store under
        ``salt`` and fixed per ``params``; stores the chunks that had no cache."""
        import torch

        _check_spans(spans, len(token_ids))
        model = self._model.get()
        h = spans[0][0]
        head_ids = [int(t) for t in token_ids[:h]]
        head_key = self.key("head", head_ids, salt)
        head_kv = self.store.head(head_key)
        head_cached = head_kv is not None
        if head_kv is None:
            if head_ids:
                head_kv = _own(full_prefill(model, head_ids))
            else:
                head_kv = empty_kv(model, torch.arange(0, dtype=torch.int64))
            self.store.put_head(head_key, head_kv)
        ids = [tuple(int(t) for t in token_ids[s:e]) for s, e in spans]
        hashes = [segment_hash(self.model_id, c) for c in ids]
        # The cci rule and CFO counts read attention statistics a read-back variant lacks.
        needs_attention = params.rule == "cci" or params.alpha is not None
        chunks: list[ChunkKV] = []
        missing: list[bool] = []
        in_place: list[bool] = []
        for i, ((s, _), c) in enumerate(zip(spans, ids, strict=True)):
            key = CacheKey("chunk", self.model_id, salt or "", hashes[i])
            # A read-back variant (the engine's exact K/V) at its own position after the same
            # head and chunks is exact here: chosen first, nothing to fix (its statistics,
            # missing, are never read: its count is 0).
            context = context_hash(self.model_id, [head_ids, *ids[:i]])
            found = next((v for v in self.store.variants(key) if not v.measured
                          and v.start_position == s and v.context == context), None)
            in_place.append(found is not None)
            if found is None:
                found = self.store.best_variant(key, hashes[:i], measured_only=needs_attention)
            missing.append(found is None)
            chunks.append(found if found is not None else _placeholder(model, self.model_id, c, s))
        selection = self._select(model, head_ids, head_kv, chunks, missing, in_place, spans,
                                 params, seed)
        stats = {i: _Stats(e - s, i, head_kv.positions.device)
                 for i, ((s, e), m) in enumerate(zip(spans, missing, strict=True)) if m}
        rows: dict[int, int] = {}
        offset = 0
        for i, picked in enumerate(selection.per_chunk):
            rows[i] = offset
            offset += len(picked)

        def observe(_layer: int, probs: torch.Tensor) -> None:
            for i, st in stats.items():
                s, e = spans[i]
                r = probs[:, rows[i]: rows[i] + e - s, :].mean(dim=0)  # [n, T] over heads
                st.per_token.add_(r[:, :s].sum(dim=1))
                st.head += float(r[:, :h].sum())
                for j in range(i):
                    a, b = spans[j]
                    st.inter[j] += float(r[:, a:b].sum())
                st.intra += float(r[:, s:e].sum())

        out = blend_prefill(model, head_ids, head_kv, chunks, selection,
                            observer=observe if stats else None)
        layers = len(model.model.layers)
        for i, st in stats.items():
            s, e = spans[i]
            inter = [x / layers for x in st.inter]
            variant = ChunkKV(
                model_id=self.model_id,
                token_ids=ids[i],
                kv=_own(out.kv.slice(s, e)),
                context=context_hash(self.model_id, [head_ids, *ids[:i]]),
                prior_chunks=tuple(hashes[:i]),
                inter_by_chunk=tuple(inter),
                outside_attention=(st.per_token / layers).cpu(),
                cci=context_impact(inter, [len(c) for c in ids[:i]], st.head / layers, h,
                                   st.intra / layers, e - s),
            )
            self.store.put_variant(CacheKey("chunk", self.model_id, salt or "", hashes[i]),
                                   variant)
        return BlendResult(out.kv, h, tuple(spans), selection, head_cached, tuple(missing),
                           tuple(in_place))

    def keep_read_back(self, token_ids: Sequence[int], spans: Sequence[tuple[int, int]],
                       salt: str | None, rows_of: Callable[[int, int], RowsKV | None]) -> int:
        """Store the head ``[0, spans[0][0])`` (when not held) and each chunk at ``spans`` of an
        *exactly computed* prompt as chunk-caches, their K/V read back from the engine
        (``rows_of(start, end)``: ``[tokens, kv_heads, head]`` per layer, post-RoPE at those
        positions, or ``None`` when not available). Such a variant is this chunk's exact K/V
        after its prompt's head and prior chunks, with no attention statistics
        (``measured=False``). Spans must be sorted and non-overlapping (``ValueError``
        otherwise); the chunks' context is the head plus the chunks listed before each one.
        A chunk already held with the same context is only refreshed (not read again).
        Returns the number of chunks stored. No forward; O(span tokens x kv size)."""
        import torch

        for i, (s, e) in enumerate(spans):
            if not 0 <= s < e <= len(token_ids) or (i and s < spans[i - 1][1]):
                msg = f"chunk span [{s}, {e}) is empty, outside the prompt or overlapping"
                raise ValueError(msg)
        if not spans:
            return 0
        h = spans[0][0]
        head_ids = [int(t) for t in token_ids[:h]]
        head_key = self.key("head", head_ids, salt)
        if h and self.store.head(head_key) is None:
            rows = rows_of(0, h)
            if rows is not None:
                self.store.put_head(head_key, _layer_kv(rows, 0))
        ids = [tuple(int(t) for t in token_ids[s:e]) for s, e in spans]
        hashes = [segment_hash(self.model_id, c) for c in ids]
        kept = 0
        for i, (s, e) in enumerate(spans):
            key = CacheKey("chunk", self.model_id, salt or "", hashes[i])
            context = context_hash(self.model_id, [head_ids, *ids[:i]])
            if any(v.context == context and not v.measured for v in self.store.variants(key)):
                continue  # held already (an exact prefix sent again): refreshed, not re-read
            rows = rows_of(s, e)
            if rows is None:
                continue
            variant = ChunkKV(
                model_id=self.model_id, token_ids=ids[i], kv=_layer_kv(rows, s),
                context=context,
                prior_chunks=tuple(hashes[:i]), inter_by_chunk=(0.0,) * i,
                outside_attention=torch.zeros(e - s), cci=0.5, measured=False,
            )
            kept += self.store.put_variant(key, variant)
        return kept

    @staticmethod
    def _select(model: Any, head_ids: Sequence[int], head_kv: LayerKV,
                chunks: Sequence[ChunkKV], missing: Sequence[bool], in_place: Sequence[bool],
                spans: Sequence[tuple[int, int]], params: BlendParams, seed: int) -> Selection:
        """``params``' count per cached chunk, all of a chunk without a cache, none of one
        exact in place; ranked only when some chunk keeps part of its cache."""
        counts = (fixed_counts(chunks, params.fraction) if params.fraction is not None
                  else cfo_counts(chunks, params.alpha if params.alpha is not None else 0.0))
        counts = [c.num_tokens if m else 0 if p else k
                  for c, m, p, k in zip(chunks, missing, in_place, counts, strict=True)]
        if all(k in (0, c.num_tokens) for c, k in zip(chunks, counts, strict=True)):
            return Selection(tuple(tuple(range(k)) for k in counts))
        base = assemble(model, head_ids, head_kv, chunks)
        scores = get_ranker(params.rule).scores(
            RankInput(model, base.kv, tuple(chunks), tuple(spans), seed))
        return select_top(scores, counts)


def _check_spans(spans: Sequence[tuple[int, int]], prompt_len: int) -> None:
    if not spans:
        msg = "no chunk spans"
        raise ValueError(msg)
    for i, (s, e) in enumerate(spans):
        if not 0 <= s < e <= prompt_len or (i and s != spans[i - 1][1]):
            msg = f"chunk span [{s}, {e}) is empty, outside the prompt or not contiguous"
            raise ValueError(msg)


def _layer_kv(rows: RowsKV, start: int) -> LayerKV:
    """Connector rows (``[tokens, kv_heads, head]`` per layer, any float dtype) as the model
    copy's float32 HF layout at positions ``start..``."""
    import torch

    keys, values = rows
    n = int(keys[0].shape[0])
    return LayerKV(tuple(k.to(torch.float32).transpose(0, 1).contiguous() for k in keys),
                   tuple(v.to(torch.float32).transpose(0, 1).contiguous() for v in values),
                   torch.arange(start, start + n, dtype=torch.int64))


def _own(kv: LayerKV) -> LayerKV:
    """``kv`` as compact copies (a slice must not keep its whole parent alive in the store)."""
    return LayerKV(tuple(k.contiguous().clone() for k in kv.keys),
                   tuple(v.contiguous().clone() for v in kv.values), kv.positions.clone())


def _placeholder(model: Any, model_id: str, token_ids: tuple[int, ...], start: int) -> ChunkKV:
    """A stand-in variant for a chunk without a cache: zero K/V at its new positions. Every
    token of it is selected, so :func:`blend_prefill` overwrites its K/V in every layer before
    any query reads them; its statistics are never used."""
    import torch

    n = len(token_ids)
    positions = torch.arange(start, start + n, dtype=torch.int64)
    return ChunkKV(model_id=model_id, token_ids=token_ids, kv=empty_kv(model, positions),
                   context=ContextHash(""), prior_chunks=(), inter_by_chunk=(),
                   outside_attention=torch.zeros(n), cci=0.5)
