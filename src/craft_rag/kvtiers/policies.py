"""Replacement policies of one KV tier: LRU (the baseline) and RAGCache's PGDSF.

A policy only ranks entries; the store decides which entries may be evicted (leaf-only, unpinned)
and asks :meth:`TierPolicy.victim` for the lowest priority among them. Each tier owns one policy
instance (RAGCache keeps one logical clock per tier), mutated only by that tier's store under the
store's lock, so policies are not thread-safe themselves.

Contract (``tests/kvtiers/test_policies.py`` runs one suite over every policy):
``on_insert`` then any number of ``on_access`` then ``on_remove``; ``victim`` returns the
candidate of minimum priority, ties broken by older last access then by key bytes, so eviction
orders are deterministic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from craft_rag.kvtiers.keys import BlockKey


@dataclass(slots=True)
class _Ranked:
    """Per-entry bookkeeping; owned by the policy that holds it."""

    size_bytes: int
    cost_s: float
    frequency: int
    tick: float
    priority: float


class TierPolicy:
    """Base of every tier policy: keeps a rank per key and returns the minimum.

    Invariant: the ranked keys are exactly the keys inserted and not yet removed.
    Subclasses override :meth:`_priority` only. ``clock`` gives access ticks (default: an
    internal counter, which makes orders exact in tests); inject ``time.monotonic`` for wall time.
    """

    name = "base"

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._ranks: dict[BlockKey, _Ranked] = {}
        self._counter = 0
        self._clock = clock

    def _tick(self) -> float:
        self._counter += 1
        return self._clock() if self._clock is not None else float(self._counter)

    def _priority(self, rank: _Ranked) -> float:
        raise NotImplementedError

    def on_insert(self, key: BlockKey, size_bytes: int, cost_s: float, frequency: int = 1) -> None:
        """Start ranking ``key`` (``frequency`` carries a count over from another tier). O(1).

        Raises ``RuntimeError`` if ``key`` is already ranked, ``ValueError`` for a size < 1,
        a negative cost or a frequency < 1.
        """
        if key in self._ranks:
            msg = "key already ranked; call on_access for a repeated use"
            raise RuntimeError(msg)
        if size_bytes < 1 or cost_s < 0 or frequency < 1:
            msg = (
                "need size_bytes >= 1, cost_s >= 0, frequency >= 1;"
                f" got {size_bytes}, {cost_s}, {frequency}"
            )
            raise ValueError(msg)
        rank = _Ranked(size_bytes, cost_s, frequency, self._tick(), 0.0)
        rank.priority = self._priority(rank)
        self._ranks[key] = rank

    def on_access(self, key: BlockKey) -> None:
        """Count one use of ``key`` and re-rank it. O(1). ``KeyError`` if not ranked."""
        rank = self._ranks[key]
        rank.frequency += 1
        rank.tick = self._tick()
        rank.priority = self._priority(rank)

    def on_remove(self, key: BlockKey, *, evicted: bool = False) -> None:
        """Stop ranking ``key``; ``evicted`` says the tier chose it as a victim. O(1)."""
        del self._ranks[key]

    def victim(self, candidates: Iterable[BlockKey]) -> BlockKey:
        """The candidate of minimum priority. O(len(candidates)).

        Raises ``ValueError`` if there is no candidate, ``KeyError`` for an unranked one.
        """
        best: BlockKey | None = None
        best_rank: tuple[float, float, bytes] | None = None
        for key in candidates:
            order = self.order(key)
            if best_rank is None or order < best_rank:
                best, best_rank = key, order
        if best is None:
            msg = "victim() needs at least one candidate"
            raise ValueError(msg)
        return best

    def order(self, key: BlockKey) -> tuple[float, float, bytes]:
        """``key``'s sort key: (priority, last-access tick, key bytes); lowest goes first. O(1)."""
        rank = self._ranks[key]
        return (rank.priority, rank.tick, bytes(key))

    def priority(self, key: BlockKey) -> float:
        """Current priority of ``key`` (lower is evicted first). O(1)."""
        return self._ranks[key].priority

    def frequency(self, key: BlockKey) -> int:
        """Uses counted for ``key`` since it entered this tier (insert counts one). O(1)."""
        return self._ranks[key].frequency

    def __contains__(self, key: object) -> bool:
        return key in self._ranks

    def __len__(self) -> int:
        return len(self._ranks)

    def keys(self) -> set[BlockKey]:
        """A copy of the ranked keys (for invariant checks). O(n)."""
        return set(self._ranks)


class LRUPolicy(TierPolicy):
    """Least recently used: priority is the tick of the last insert or access."""

    name = "lru"

    def _priority(self, rank: _Ranked) -> float:
        return rank.tick


class PGDSFPolicy(TierPolicy):
    """Prefix-aware Greedy-Dual-Size-Frequency (RAGCache §5.1).

    ``priority = clock + frequency * cost / size``, where ``clock`` is the highest priority
    evicted so far from this tier (Formula 3: it only grows, so entries not used for a while fall
    behind newer ones), ``frequency`` counts uses since the entry entered the tier, ``cost`` is
    the prefix-aware compute time of the block's tokens and ``size`` its payload bytes.

    RAGCache averages ``Cost_i / NewSize_i`` over the requests that missed a document (Formula 4)
    because a document's prefix varies between requests. A block here is keyed by its whole
    prefix (:func:`craft_rag.kvtiers.keys.chain_keys`), so its prefix length, and thus its
    cost from :class:`craft_rag.kvtiers.cost_model.PrefillCostModel`, is the same for every
    request: the average is that one value.
    """

    name = "pgdsf"

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        super().__init__(clock)
        self.clock_value = 0.0
        """Formula 3's clock; mutated only by :meth:`on_remove` with ``evicted=True``."""

    def _priority(self, rank: _Ranked) -> float:
        return self.clock_value + rank.frequency * rank.cost_s / rank.size_bytes

    def on_remove(self, key: BlockKey, *, evicted: bool = False) -> None:
        """Stop ranking ``key``; an eviction raises the clock to its priority. O(1)."""
        if evicted:
            self.clock_value = max(self.clock_value, self._ranks[key].priority)
        super().on_remove(key, evicted=evicted)


TIER_POLICIES: dict[str, type[TierPolicy]] = {"lru": LRUPolicy, "pgdsf": PGDSFPolicy}


def get_tier_policy(name: str, clock: Callable[[], float] | None = None) -> TierPolicy:
    """A new policy instance by registry name. ``ValueError`` names the valid ones."""
    try:
        cls = TIER_POLICIES[name]
    except KeyError:
        valid = ", ".join(sorted(TIER_POLICIES))
        msg = f"unknown tier policy {name!r}; valid: {valid}"
        raise ValueError(msg) from None
    return cls(clock)
