"""A chunk's KV as computed in one context (a *variant*), with the attention statistics that say
how much that context shaped it.

A :class:`ChunkKV` is produced by :func:`compute_chunk_kv`: the exact ``head`` (system prompt;
always the first tokens of every prompt) and the chunks that preceded the chunk when it was
computed are prefilled with it, and while the chunk's tokens pass through each layer the
attention they pay is summed per outside segment (Cache-Craft's *inter*), to themselves
(*intra*) and per token (the ranking for recomputation).

CCI (Cache Context Impact, Cache-Craft Eq. 9-11): ``a = sum_j inter_j / (|C| |C_j|)`` over the
outside segments, ``b = intra / |C|^2``, both averaged over layers (and heads), and
``CCI = sigmoid(a / b)``. The head counts as an outside segment here: in the *independent*
variant (head only) the chunk has no prior chunk, and with the paper's chunks-only sum every
such variant would get the same CCI of 0.5. The head is excluded from the prefix overlap
(:func:`craft_rag.chunkcache.selection.beta_prime`) because it is identical in every prompt.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType

from craft_rag.chunkcache.layers import LayerKV, device_of, embed, empty_kv, run_layers

if TYPE_CHECKING:
    import torch

SegmentHash = NewType("SegmentHash", str)
"""sha256 (hex) of a model id and one segment's token ids: names a chunk or a head."""

ContextHash = NewType("ContextHash", str)
"""sha256 (hex) of a model id and the token ids of everything before a chunk: names a variant."""


def segment_hash(model_id: str, token_ids: Sequence[int]) -> SegmentHash:
    """Hash of one segment. O(len(token_ids))."""
    return SegmentHash(_digest(model_id, [token_ids]))


def context_hash(model_id: str, segments: Sequence[Sequence[int]]) -> ContextHash:
    """Hash of a context given as segments (head first); segment boundaries are part of it."""
    return ContextHash(_digest(model_id, segments))


def _digest(model_id: str, segments: Sequence[Sequence[int]]) -> str:
    h = hashlib.sha256(model_id.encode())
    for seg in segments:
        h.update(b"|" + ",".join(str(t) for t in seg).encode())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class ChunkKV:
    """One chunk-cache variant. Immutable once computed.

    Invariants: ``kv`` holds exactly ``len(token_ids)`` tokens at the consecutive positions
    where they were computed; ``outside_attention`` has one entry per token;
    ``prior_chunks`` and ``inter_by_chunk`` have one entry per chunk that preceded this one
    (in their old order); ``0 < cci < 1``.
    """

    model_id: str
    token_ids: tuple[int, ...]
    kv: LayerKV
    context: ContextHash
    prior_chunks: tuple[SegmentHash, ...]
    inter_by_chunk: tuple[float, ...]
    """Cache-Craft's ``inter(i, j)`` per prior chunk ``j``: attention from this chunk's queries
    to ``j``'s keys, summed over query and key tokens, averaged over heads and layers."""
    outside_attention: torch.Tensor
    """Per token: attention to every token before the chunk (head included), averaged over
    heads and layers (Eq. 14's ranking)."""
    cci: float
    measured: bool = True
    """Whether ``outside_attention``, ``inter_by_chunk`` and ``cci`` were measured. False for a
    variant read back from the engine's exactly computed KV blocks (no attention seen): its
    statistics are neutral stand-ins (zeros, CCI 0.5), so the ``cci`` rule and CFO counts must
    not use it (:meth:`craft_rag.kvtiers.blend_source.ChunkCacheStore.best_variant`)."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        assert self.kv.num_tokens == n
        assert int(self.outside_attention.shape[0]) == n
        assert len(self.prior_chunks) == len(self.inter_by_chunk)
        assert 0.0 < self.cci < 1.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def start_position(self) -> int:
        return int(self.kv.positions[0])

    @property
    def chunk_hash(self) -> SegmentHash:
        return segment_hash(self.model_id, self.token_ids)


def context_impact(inter: Sequence[float], prior_lens: Sequence[int], head_inter: float,
                   head_len: int, intra: float, n: int) -> float:
    """CCI of a chunk of ``n`` tokens (module docstring) from its attention sums, each summed
    over query and key tokens and averaged over heads and layers: ``inter[j]`` to prior chunk
    ``j`` of ``prior_lens[j]`` tokens, ``head_inter`` to the head of ``head_len`` tokens,
    ``intra`` to itself. Clamped into (0, 1)."""
    a = sum(x / (n * m) for x, m in zip(inter, prior_lens, strict=True))
    if head_len:
        a += head_inter / (n * head_len)
    b = intra / (n * n)
    ratio = a / b if b > 0 else math.inf
    # Clamped away from 0 and 1 so a variant always keeps a defined CCI in (0, 1).
    return min(max(1.0 / (1.0 + math.exp(-min(ratio, 50.0))), 1e-12), 1.0 - 1e-12)


def compute_chunk_kv(
    model: Any,
    head_ids: Sequence[int],
    chunk_ids: Sequence[int],
    *,
    prior_chunks: Sequence[Sequence[int]] = (),
    model_id: str,
) -> ChunkKV:
    """Prefill ``head + prior_chunks + chunk`` from position 0 and keep the chunk's KV and
    attention statistics. ``ValueError`` for an empty chunk.

    Cost: one full prefill of ``T`` tokens with the hand-written layer loop (O(T^2) attention per
    layer; the statistics add O(|C| x T) per layer).
    """
    import torch

    if not chunk_ids:
        msg = "chunk_ids is empty: a chunk-cache needs at least one token"
        raise ValueError(msg)
    segments = [list(head_ids), *[list(c) for c in prior_chunks]]
    outside = sum(len(s) for s in segments)
    n = len(chunk_ids)
    dev = device_of(model)
    ids = torch.tensor([t for s in segments for t in s] + list(chunk_ids), dtype=torch.int64,
                       device=dev)
    total = int(ids.shape[0])
    bounds: list[tuple[int, int]] = []
    start = len(head_ids)
    for c in prior_chunks:
        bounds.append((start, start + len(c)))
        start += len(c)
    layers = len(model.model.layers)
    inter = [0.0] * len(bounds)
    head_inter = 0.0
    intra = 0.0
    per_token = torch.zeros(n, device=dev)

    def observe(_layer: int, probs: torch.Tensor) -> None:
        nonlocal intra, head_inter
        rows = probs[:, outside:, :].mean(dim=0)  # [n, T], averaged over heads
        per_token.add_(rows[:, :outside].sum(dim=1))
        head_inter += float(rows[:, : len(head_ids)].sum())
        for j, (a, b) in enumerate(bounds):
            inter[j] += float(rows[:, a:b].sum())
        intra += float(rows[:, outside:].sum())

    with torch.no_grad():
        positions = torch.arange(total, dtype=torch.int64, device=dev)
        _, kv = run_layers(model, embed(model, ids), positions, empty_kv(model, positions),
                           observer=observe)
    inter = [x / layers for x in inter]
    cci = context_impact(inter, [len(c) for c in prior_chunks], head_inter / layers,
                         len(head_ids), intra / layers, n)
    return ChunkKV(
        model_id=model_id,
        token_ids=tuple(int(t) for t in chunk_ids),
        kv=kv.slice(outside, total),
        context=context_hash(model_id, segments),
        prior_chunks=tuple(segment_hash(model_id, c) for c in prior_chunks),
        inter_by_chunk=tuple(inter),
        outside_attention=(per_token / layers).cpu(),
        cci=cci,
    )
