"""Which tokens of each reused chunk to recompute: how many (a count rule) and which (a ranker).

Counts: :func:`fixed_counts` recomputes ``ceil(f x |C|)`` tokens of every chunk (the curves);
:func:`cfo_counts` follows Cache-Craft: ``N = ceil(CFO x |C|)`` with
``CFO = min(1, alpha x CCI x (1 - beta'))`` (Eq. 12), ``beta' = beta x (1 - gamma)`` (Eq. 8):
``beta`` is the share of the variant's inter-attention that went to prior chunks that are also
before it now (Eq. 6), ``gamma`` the normalised Kendall tau distance between the old and new
order of those shared chunks (Eq. 7). A variant computed with no prior chunk has ``beta = 0``
(nothing of its old context is known to be present).

Rankers (registry :data:`RANKERS`, names ``cci``, ``kv_deviation``, ``random``) score every
token of every chunk; the top ``N`` per chunk are recomputed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from craft_rag.chunkcache.layers import LayerKV, device_of, embed, run_layers
from craft_rag.chunkcache.variants import ChunkKV, SegmentHash

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class Selection:
    """Token indices to recompute, per chunk, relative to the chunk's first token. Invariant:
    each tuple is sorted, without repeats, within ``[0, |C|)``."""

    per_chunk: tuple[tuple[int, ...], ...]

    @property
    def total(self) -> int:
        return sum(len(s) for s in self.per_chunk)


@dataclass(frozen=True, slots=True)
class RankInput:
    """What a ranker may look at: the model, the assembled span (head exact, chunks moved to
    their new positions, nothing recomputed), the chunks in their new order and where each sits
    in the span (``spans[i] = (start, end)`` slots), and a seed for random choices."""

    model: Any
    assembled: LayerKV
    chunks: tuple[ChunkKV, ...]
    spans: tuple[tuple[int, int], ...]
    seed: int = 0


class Ranker(Protocol):
    name: ClassVar[str]

    def scores(self, inp: RankInput) -> list[torch.Tensor]:
        """One ``[|C|]`` score vector per chunk; higher means recompute first."""
        ...


class OutsideAttentionRanker:
    """Cache-Craft Eq. 14: the tokens that paid most attention to their old outside context.
    Free at request time (stored with the variant)."""

    name: ClassVar[str] = "cci"

    def scores(self, inp: RankInput) -> list[torch.Tensor]:
        return [c.outside_attention for c in inp.chunks]


class KvDeviationRanker:
    """CacheBlend: run layer 0 for every chunk token against the assembled span, compute layer
    1's K/V from its output and rank tokens by ``|K_new - K_cached|^2 + |V_new - V_cached|^2``
    (layer 0's own K/V depend on the token alone, so layer 1 is the first to deviate).
    Cost: about two layers of a full prefill of the chunks."""

    name: ClassVar[str] = "kv_deviation"

    def scores(self, inp: RankInput) -> list[torch.Tensor]:
        import torch

        model = inp.model
        dev = device_of(model)
        slots = torch.cat([torch.arange(a, b, device=dev) for a, b in inp.spans])
        ids = torch.tensor([t for c in inp.chunks for t in c.token_ids], dtype=torch.int64,
                           device=dev)
        with torch.no_grad():
            hidden, _ = run_layers(model, embed(model, ids), slots, inp.assembled,
                                   layers=range(0, 1))
            _, fresh = run_layers(model, hidden, slots, inp.assembled, layers=range(1, 2))
        dk = (fresh.keys[1][:, slots] - inp.assembled.keys[1][:, slots]).pow(2).sum(dim=(0, 2))
        dv = (fresh.values[1][:, slots] - inp.assembled.values[1][:, slots]).pow(2)
        deviation = (dk + dv.sum(dim=(0, 2))).cpu()
        out: list[torch.Tensor] = []
        offset = 0
        for c in inp.chunks:
            out.append(deviation[offset: offset + c.num_tokens])
            offset += c.num_tokens
        return out


class RandomRanker:
    """Uniformly random tokens (the control), reproducible from ``RankInput.seed``."""

    name: ClassVar[str] = "random"

    def scores(self, inp: RankInput) -> list[torch.Tensor]:
        import torch

        gen = torch.Generator().manual_seed(inp.seed)
        return [torch.rand(c.num_tokens, generator=gen) for c in inp.chunks]


RANKERS: dict[str, Ranker] = {
    r.name: r for r in (OutsideAttentionRanker(), KvDeviationRanker(), RandomRanker())
}
"""Ranker name -> ranker."""


def get_ranker(name: str) -> Ranker:
    """The ranker called ``name``; ``ValueError`` naming the valid ones."""
    try:
        return RANKERS[name]
    except KeyError:
        msg = f"unknown token selection rule {name!r}; choose one of {sorted(RANKERS)}"
        raise ValueError(msg) from None


def fixed_counts(chunks: Sequence[ChunkKV], fraction: float) -> list[int]:
    """``ceil(fraction x |C|)`` per chunk; ``ValueError`` unless ``0 <= fraction <= 1``."""
    if not (isinstance(fraction, int | float) and 0.0 <= fraction <= 1.0):
        msg = f"recompute fraction must be a number in [0, 1], got {fraction!r}"
        raise ValueError(msg)
    # The small epsilon keeps 0.3 x 10 from becoming 4 through float rounding.
    return [min(c.num_tokens, math.ceil(fraction * c.num_tokens - 1e-9)) for c in chunks]


def kendall_distance(old: Sequence[SegmentHash], new: Sequence[SegmentHash]) -> float:
    """Normalised Kendall tau distance (discordant pairs / all pairs) between the order of the
    items common to ``old`` and ``new``; 0 with fewer than two common items. O(m^2)."""
    common = set(old) & set(new)
    a = [x for x in old if x in common]
    rank = {x: i for i, x in enumerate(x for x in new if x in common)}
    m = len(a)
    if m < 2:
        return 0.0
    discordant = sum(1 for i in range(m) for j in range(i + 1, m) if rank[a[i]] > rank[a[j]])
    return discordant / (m * (m - 1) / 2)


def beta_prime(chunk: ChunkKV, new_prior: Sequence[SegmentHash]) -> float:
    """Adjusted prefix overlap of ``chunk`` when the chunks ``new_prior`` precede it now.
    O(m^2) in the number of shared prior chunks."""
    total = sum(chunk.inter_by_chunk)
    if not chunk.prior_chunks or total <= 0.0:
        return 0.0
    present = set(new_prior)
    shared = sum(w for h, w in zip(chunk.prior_chunks, chunk.inter_by_chunk, strict=True)
                 if h in present)
    return (shared / total) * (1.0 - kendall_distance(chunk.prior_chunks, new_prior))


def cfo(chunk: ChunkKV, new_prior: Sequence[SegmentHash], alpha: float) -> float:
    """Cache Fix Overhead ``min(1, alpha x CCI x (1 - beta'))``; ``ValueError`` for a
    negative or non-finite ``alpha``."""
    if not (isinstance(alpha, int | float) and math.isfinite(alpha) and alpha >= 0.0):
        msg = f"alpha must be a finite number >= 0, got {alpha!r}"
        raise ValueError(msg)
    return min(1.0, alpha * chunk.cci * (1.0 - beta_prime(chunk, new_prior)))


def cfo_counts(chunks: Sequence[ChunkKV], alpha: float) -> list[int]:
    """Cache-Craft's ``ceil(CFO x |C|)`` per chunk, the chunks given in their new order (each
    one's new prior chunks are the ones before it in ``chunks``)."""
    out: list[int] = []
    for i, c in enumerate(chunks):
        prior = [p.chunk_hash for p in chunks[:i]]
        out.append(min(c.num_tokens, math.ceil(cfo(c, prior, alpha) * c.num_tokens - 1e-9)))
    return out


def select_top(scores: Sequence[torch.Tensor], counts: Sequence[int]) -> Selection:
    """The ``counts[i]`` highest-scoring tokens of chunk ``i`` (ties: lower index first).
    ``ValueError`` when the lengths disagree. O(sum |C| log |C|)."""
    import torch

    if len(scores) != len(counts):
        msg = f"{len(scores)} score vectors for {len(counts)} counts"
        raise ValueError(msg)
    per: list[tuple[int, ...]] = []
    for s, k in zip(scores, counts, strict=True):
        order = torch.sort(s.cpu(), descending=True, stable=True).indices[:k]
        per.append(tuple(sorted(int(i) for i in order)))
    return Selection(tuple(per))


def select_tokens(
    rule: str, inp: RankInput, *, fraction: float | None = None, alpha: float | None = None
) -> Selection:
    """Rank with ``rule`` and keep ``fraction`` of every chunk, or Cache-Craft's CFO count
    for ``alpha``; exactly one of the two must be given (``ValueError`` otherwise)."""
    ranker = get_ranker(rule)
    if (fraction is None) == (alpha is None):
        msg = "give exactly one of fraction= (fixed share) or alpha= (Cache-Craft CFO count)"
        raise ValueError(msg)
    counts = (fixed_counts(inp.chunks, fraction) if fraction is not None
              else cfo_counts(inp.chunks, alpha if alpha is not None else 0.0))
    if all(k == 0 for k in counts):
        return Selection(tuple(() for _ in inp.chunks))
    return select_top(ranker.scores(inp), counts)
