"""``CraftApproxConnector``: the tier connector plus approximate KV for spans of a prompt.

Load it like :class:`~craft_rag.kvtiers.connector.CraftTierConnector` (same extra config, plus
an optional ``"kv_sources": {"name": "package.module:Class"}``), naming
``"kv_connector": "CraftApproxConnector"`` and
``"kv_connector_module_path": "craft_rag.kvtiers.approx_connector"``.

A request without ``craft_approx`` in its ``kv_transfer_params`` is served exactly as the tier
connector serves it. A request with one (:mod:`craft_rag.kvtiers.approx_params`) gets:

1. the longest exact prefix the tiers hold, keyed under its tenant salt (whole blocks,
   verified, as the tier connector loads them): ``[0, E)``;
2. K/V for ``[E, A)``: the request's spans (clipped to start at ``E``), each from its named
   :mod:`source <craft_rag.kvtiers.kv_sources>`, and any gap between ``E`` and the first span
   from ``hf_prefill`` (vLLM accepts only one contiguous external run, so the connector
   computes what lies inside it);
3. vLLM computes ``[A, prompt)``.
A request whose spans are all ``chunk`` spans gets ``[E, A)`` from the chunk-cache assembler
(:mod:`craft_rag.kvtiers.blend_source`: chunk-caches re-rotated, selected tokens recomputed
against the assembled context, new chunks computed and stored), bounded by the extra config's
``chunk_cache_bytes`` / ``chunk_cache_variants``.
All of ``[E, A)`` is produced and checked (layer count, shapes, finite values) at scheduling
time, before anything is promised: a missing source, a span a source cannot serve, a wrong
model or a request without a request-scoped salt means the request is computed normally
(tier prefix only), with the reason in its report. The worker writes the tokens with vLLM's
own cache kernel (:mod:`craft_rag.kvtiers.layout_cpu_tokens`).

**Harvest.** An *exact* request (its tenant's own salt) may list its chunk spans under
``craft_chunks`` (:data:`~craft_rag.kvtiers.approx_params.HARVEST_PARAMS_KEY`). Once it has
finished, each listed chunk (and the head before the first) that lies in full prompt blocks
the tiers hold is read back from those exactly computed blocks
(:mod:`craft_rag.kvtiers.layout_cpu_readback`) and kept as a chunk-cache variant: the store
fills at no extra forward, and cold requests need no chunk spans. The read-back runs at the
start of the next scheduling call (when the request's last blocks are in the tiers); a
malformed list, a missing block or an engine whose packing cannot be read back (probed once)
only means nothing is kept.

Isolation (the rule is stated in :mod:`craft_rag.kvtiers.approx_params`): approximate KV only
under a request-scoped ``cache_salt``; such a request's exact prefix comes from the tiers
under the tenant salt; none of its blocks is ever saved to the tiers.

Cost when no request asks: the tier connector's, plus one dict lookup per request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from craft_rag.kvtiers.approx_params import (
    CHUNK_SOURCE,
    REUSE_PARAMS_KEY,
    ApproxRequest,
    ReuseCounts,
    is_request_scoped,
    parse_approx,
    parse_harvest,
    tenant_salt,
)
from craft_rag.kvtiers.blend_source import (
    DEFAULT_CHUNK_CACHE_BYTES,
    DEFAULT_VARIANTS,
    BlendAssembler,
    ChunkCacheStore,
)
from craft_rag.kvtiers.connector import TIER_PARAMS_KEY, CraftTierConnector, CraftTierMetadata
from craft_rag.kvtiers.keys import BlockKey
from craft_rag.kvtiers.kv_sources import KVSource, LayerKV, LazyModel, build_sources
from craft_rag.kvtiers.layout_cpu_readback import CpuBlockReader
from craft_rag.kvtiers.layout_cpu_tokens import slot_mapping, write_tokens

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["CraftApproxConnector", "CraftApproxMetadata"]

logger = logging.getLogger(__name__)

GAP_SOURCE = "hf_prefill"


@dataclass
class CraftApproxMetadata(CraftTierMetadata):
    """The tier connector's loads and saves, plus token writes: (block ids of the request,
    start, end, per-layer K, per-layer V), applied after the block loads."""

    writes: list[tuple[list[int], int, int, list[Any], list[Any]]] = field(default_factory=list)


@dataclass(slots=True)
class _Approx:
    """One approximate-KV request as the scheduler role sees it (owned by that role)."""

    counts: ReuseCounts
    request: ApproxRequest | None  # None once refused
    pool_tokens: int | None = None  # vLLM's own prefix hit, at the first ask
    staged_at: int | None = None  # num_computed_tokens the staged KV was built for
    exact_end: int = 0
    staged: LayerKV | None = None
    kinds: dict[str, int] = field(default_factory=dict)  # counts_as -> tokens
    served: bool = False  # its staged K/V was handed to vLLM


@dataclass(frozen=True, slots=True)
class _Harvest:
    """A finished exact request's chunks to read back (owned by the scheduler role)."""

    salt: str | None  # the tenant salt its blocks are keyed under
    token_ids: tuple[int, ...]  # the prompt
    keys: tuple[BlockKey, ...]  # its full prompt blocks' tier keys
    spans: tuple[tuple[int, int], ...]  # listed chunks inside those blocks


class CraftApproxConnector(CraftTierConnector):
    """Serves approximate KV for requests that ask, under the isolation rule; see the module
    docstring. Invariant (scheduler role): a promise beyond the tier blocks is backed by
    staged, checked K/V of exactly ``[exact_end, end)``."""

    extra_config_keys: ClassVar[frozenset[str]] = frozenset(
        {"kv_sources", "chunk_cache_bytes", "chunk_cache_variants"}
    )

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self.extra_config
        model = vllm_config.model_config
        served = getattr(model, "served_model_name", None) or []
        served = [served] if isinstance(served, str) else list(served)
        self._models = {str(model.model), *map(str, served)}  # what "model" may name
        own_sources = extra.get("kv_sources") or {}
        if CHUNK_SOURCE in own_sources:
            msg = f"kv source {CHUNK_SOURCE!r} is the chunk-cache assembler; choose another name"
            raise ValueError(msg)
        shared = LazyModel(str(model.model))
        self._sources: dict[str, KVSource] = build_sources(
            str(model.model), own_sources, model=shared
        )
        self._assembler = BlendAssembler(
            str(model.model), shared,
            ChunkCacheStore(extra.get("chunk_cache_bytes", DEFAULT_CHUNK_CACHE_BYTES),
                            extra.get("chunk_cache_variants", DEFAULT_VARIANTS)),
        )
        self._approx: dict[str, _Approx] = {}
        self._writes: list[tuple[list[int], int, int, list[Any], list[Any]]] = []
        self._harvests: list[_Harvest] = []  # read back at the next scheduling call
        self._reader: CpuBlockReader | None = None
        self._reader_failed = False
        self.harvested_chunks = 0  # chunks kept from exact requests, for tests and logs

    # ------------------------------------------------------------ scheduler role

    def _salt_for(self, request: Request) -> str | None:
        """Tier keys under the tenant salt (a request-scoped salt's tenant part)."""
        return tenant_salt(request.cache_salt)

    def _saves_blocks(self, request: Request) -> bool:
        """A request-scoped request never saves (its blocks are approximate or came from the
        tiers)."""
        return not is_request_scoped(request.cache_salt)

    def _ask(self, request: Request) -> _Approx | None:
        entry = self._approx.get(request.request_id)
        if entry is not None:
            return entry
        params = request.kv_transfer_params
        if not params or "craft_approx" not in params:
            return None
        prompt_len = len(request.prompt_token_ids or [])
        entry = _Approx(counts=ReuseCounts(), request=None)
        try:
            entry.request = parse_approx(params, prompt_len, {*self._sources, CHUNK_SOURCE})
        except ValueError as e:
            entry.counts.refused = f"bad request: {e}"
        if entry.request is not None:
            if entry.request.model is not None and entry.request.model not in self._models:
                entry.counts.refused = f"wrong model {entry.request.model!r:.80}"
                entry.request = None
            elif not is_request_scoped(request.cache_salt):
                entry.counts.refused = (
                    "no request-scoped cache_salt (make one with approx_params.request_scoped_salt)"
                )
                entry.request = None
        self._approx[request.request_id] = entry
        return entry

    def _block_reader(self) -> CpuBlockReader | None:
        """The engine's packing, probed once (None, logged once, when it cannot be read)."""
        if self._reader is None and not self._reader_failed:
            import torch

            layers, heads, head_size = self._vllm_layout()
            cache_dtype = str(self._vllm_config.cache_config.cache_dtype)
            dtype = self._vllm_config.model_config.dtype
            try:
                if cache_dtype != "auto" or not isinstance(dtype, torch.dtype):
                    msg = f"KV cache dtype {cache_dtype!r}"
                    raise NotImplementedError(msg)
                self._reader = CpuBlockReader.probe(layers, heads, self._block_size, head_size,
                                                    dtype)
            except Exception as e:  # an optional feature: never fail the scheduler over it
                self._reader_failed = True
                logger.warning("CraftApproxConnector: chunk-cache read-back off: %r", e)
        return self._reader

    def _queue_harvest(self, request: Request) -> None:
        """Note an exact request's listed chunks (inside its full prompt blocks) for read-back.
        Bad lists are ignored (the request itself was served normally)."""
        if is_request_scoped(request.cache_salt):
            return
        state = self._requests.get(request.request_id)
        if state is None:
            return
        try:
            spans = parse_harvest(request.kv_transfer_params, len(state.token_ids))
        except ValueError as e:
            logger.debug("CraftApproxConnector: harvest list ignored: %s", e)
            return
        bound = len(state.keys) * self._block_size
        spans = tuple(sp for sp in spans if sp[1] <= bound)
        if spans:
            self._harvests.append(_Harvest(self._salt_for(request), tuple(state.token_ids),
                                           tuple(state.keys), spans))

    def _harvest(self) -> None:
        """Read back queued chunks into the chunk-cache store (module docstring)."""
        if not self._harvests:
            return
        todo, self._harvests = self._harvests, []
        for item in todo:
            self._keep_read_back(item)

    def _keep_read_back(self, item: _Harvest) -> int:
        """Keep ``item``'s chunks (and head) read back from its tier blocks; chunks kept (0
        when the packing cannot be read back or a block is gone)."""
        reader = self._block_reader()
        if reader is None:
            return 0
        bs = self._block_size
        payloads: dict[int, bytes | None] = {}

        def block(j: int) -> bytes | None:
            if j not in payloads:
                payloads[j] = self.store.peek(item.keys[j],
                                              item.token_ids[j * bs:(j + 1) * bs])
            return payloads[j]

        def rows_of(start: int, end: int) -> LayerKV | None:
            first, last = start // bs, (end - 1) // bs
            got = [block(j) for j in range(first, last + 1)]
            if any(p is None for p in got):
                return None
            assert reader is not None
            return reader.rows([p for p in got if p is not None], start - first * bs,
                               end - first * bs)

        try:
            kept = self._assembler.keep_read_back(item.token_ids, item.spans, item.salt, rows_of)
        except Exception as e:  # as above: the request itself was served; nothing is kept
            logger.warning("CraftApproxConnector: read-back failed: %r", e)
            return 0
        self.harvested_chunks += kept
        return kept

    def _check(self, kv: LayerKV | None, tokens: int) -> str | None:
        """Why ``kv`` cannot be written for ``tokens`` tokens (None: it can)."""
        if kv is None:
            return "source has no KV for the span"
        keys, values = kv
        layout = self._vllm_layout()
        if len(keys) != layout[0] or len(values) != layout[0]:
            return f"{len(keys)} layers of KV for a model of {layout[0]}"
        want = (tokens, layout[1], layout[2])
        for k, v in zip(keys, values, strict=True):
            if tuple(k.shape) != want or tuple(v.shape) != want:
                return f"KV of shape {tuple(k.shape)}, expected {want}"
            if not (bool(k.isfinite().all()) and bool(v.isfinite().all())):
                return "non-finite KV"
        return None

    def _vllm_layout(self) -> tuple[int, int, int]:
        """(layers, kv heads, head size) of the served model."""
        model = self._vllm_config.model_config
        hf = model.hf_text_config
        layers = int(hf.num_hidden_layers)
        heads = int(model.get_num_kv_heads(self._vllm_config.parallel_config))
        return layers, heads, int(model.get_head_size())

    def _build_blend(self, request: Request, entry: _Approx, exact_end: int) -> int:
        """Stage K/V of ``[exact_end, end)`` from the chunk-cache assembler
        (:mod:`~craft_rag.kvtiers.blend_source`); the number of tokens staged (0: refused)."""
        ask = entry.request
        assert ask is not None and ask.blend is not None
        tokens = list(request.prompt_token_ids or [])
        # The chunks inside the tiers' exact prefix [0, exact_end) (and the head) are read back
        # from those blocks first, so the assembler uses vLLM's exact K/V there (in place:
        # nothing recomputed) instead of computing a chunk its store lacks.
        state = self._requests.get(request.request_id)
        spans = [(s.start, s.end) for s in ask.spans]
        inside = tuple(sp for sp in spans if sp[1] <= exact_end)
        if inside and state is not None:  # exact_end never passes the request's full blocks
            self._keep_read_back(_Harvest(tenant_salt(request.cache_salt), tuple(tokens),
                                          tuple(state.keys), inside))
        try:
            result = self._assembler.assemble(
                tokens, spans, ask.blend,
                tenant_salt(request.cache_salt),
            )
        except ValueError as e:
            entry.counts.refused = f"chunk spans: {e}"
            return 0
        kv = result.rows(exact_end)
        why = self._check(kv, ask.end - exact_end)
        if why is not None:
            entry.counts.refused = why
            return 0
        exact, fixed, recomputed = result.counts(exact_end)
        entry.staged = kv
        entry.kinds = {"exact": exact, "fixed": fixed, "recomputed": recomputed}
        entry.exact_end = exact_end
        return ask.end - exact_end

    def _build(self, request: Request, entry: _Approx, exact_end: int) -> int:
        """Stage K/V of ``[exact_end, end)``; the number of tokens staged (0: refused)."""
        ask = entry.request
        assert ask is not None
        if ask.blend is not None:
            return self._build_blend(request, entry, exact_end)
        tokens = list(request.prompt_token_ids or [])
        pieces: list[tuple[int, int, str, Any]] = []
        if exact_end < ask.start:
            pieces.append((exact_end, ask.start, GAP_SOURCE, {}))
        for span in ask.spans:
            if span.end > exact_end:
                pieces.append((max(span.start, exact_end), span.end, span.source, span.spec))
        if not pieces:
            return 0
        keys: list[list[Any]] = []
        values: list[list[Any]] = []
        kinds: dict[str, int] = {}
        for start, end, name, spec in pieces:
            source = self._sources[name]
            why: str | None
            try:
                kv = source.kv(tokens, start, end, spec)
            except ValueError as e:
                kv, why = None, f"span [{start}, {end}) from {name}: {e}"
            else:
                why = self._check(kv, end - start)
            if why is not None:
                entry.counts.refused = why
                return 0
            assert kv is not None
            keys.append(kv[0])
            values.append(kv[1])
            kind = type(source).counts_as
            kinds[kind] = kinds.get(kind, 0) + end - start
        import torch

        layers = len(keys[0])
        entry.staged = (
            [torch.cat([k[i] for k in keys]) for i in range(layers)],
            [torch.cat([v[i] for v in values]) for i in range(layers)],
        )
        entry.kinds, entry.exact_end = kinds, exact_end
        return ask.end - exact_end

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The tier connector's exact blocks, then (for a request that asks, under the rule)
        the approximate run up to its last span's end. Builds all K/V now (see module doc);
        a repeated call with the same ``num_computed_tokens`` reuses what was staged."""
        self._harvest()
        exact, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        entry = self._ask(request)
        if entry is None or exact is None:
            return exact, load_async
        if entry.pool_tokens is None:
            entry.pool_tokens = num_computed_tokens
        if entry.request is None:
            return exact, load_async
        exact_end = num_computed_tokens + exact
        if entry.staged_at != num_computed_tokens or entry.exact_end != exact_end:
            entry.staged, entry.staged_at = None, num_computed_tokens
            if exact_end < entry.request.end and self._build(request, entry, exact_end) == 0:
                entry.request = None  # refused: computed normally from here on
                return exact, load_async
        if entry.staged is None:
            return exact, load_async
        return entry.request.end - num_computed_tokens, load_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        entry = self._approx.get(request.request_id)
        staged = entry.staged if entry is not None else None
        if entry is None or staged is None or num_external_tokens <= 0:
            super().update_state_after_alloc(request, blocks, num_external_tokens)
            return
        assert entry.request is not None and entry.staged_at is not None
        exact = entry.exact_end - entry.staged_at
        assert num_external_tokens == entry.request.end - entry.staged_at, (
            "vLLM accepted a different number of external tokens than promised"
        )
        super().update_state_after_alloc(request, blocks, exact)
        block_ids = list(blocks.get_block_ids()[0])
        self._writes.append((block_ids, entry.exact_end, entry.request.end, *staged))
        entry.staged, entry.served = None, True
        entry.counts.exact = (entry.pool_tokens or 0) + exact + entry.kinds.get("exact", 0)
        entry.counts.fixed = entry.kinds.get("fixed", 0)
        entry.counts.recomputed = entry.kinds.get("recomputed", 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> CraftApproxMetadata:
        self._harvest()
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, CraftTierMetadata)
        out = CraftApproxMetadata(loads=meta.loads, saves=meta.saves, writes=self._writes)
        self._writes = []
        return out

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The tier connector's report, plus ``craft_reuse`` for a request that asked; an
        exact request's ``craft_chunks`` are queued for read-back."""
        self._queue_harvest(request)
        delay, params = super().request_finished(request, block_ids)
        entry = self._approx.pop(request.request_id, None)
        if entry is None:
            return delay, params
        counts = entry.counts
        if not entry.served:  # refused or never scheduled
            tiers = (params or {}).get(TIER_PARAMS_KEY) or {}
            tier_tokens = int(tiers.get("ram_tokens", 0)) + int(tiers.get("disk_tokens", 0))
            counts.exact = (entry.pool_tokens or 0) + tier_tokens
        prompt_len = len(request.prompt_token_ids or [])
        counts.computed = prompt_len - counts.exact - counts.fixed - counts.recomputed
        return delay, {**(params or {}), REUSE_PARAMS_KEY: counts.to_params()}

    # ------------------------------------------------------------ worker role

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """The tier blocks, then the token writes (which never touch a tier block's slots:
        they start at the end of the exact prefix)."""
        super().start_load_kv(forward_context, **kwargs)
        meta = self._get_connector_metadata()
        if not isinstance(meta, CraftApproxMetadata) or not meta.writes:
            return
        assert self._layout is not None, "register_kv_caches was not called"
        for block_ids, start, end, keys, values in meta.writes:
            slots = slot_mapping(block_ids, self._block_size, start, end)
            write_tokens(self._kv_caches, self._layout, slots, keys, values)

