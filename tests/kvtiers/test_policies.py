"""Tier policies: one contract suite over every registered policy, then exact orders."""

from __future__ import annotations

import pytest

from craft_rag.kvtiers.keys import BlockKey
from craft_rag.kvtiers.policies import (
    TIER_POLICIES,
    LRUPolicy,
    PGDSFPolicy,
    TierPolicy,
    get_tier_policy,
)


def k(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "big"))


@pytest.fixture(params=sorted(TIER_POLICIES))
def policy(request: pytest.FixtureRequest) -> TierPolicy:
    return get_tier_policy(request.param)


# ------------------------------------------------------------------ contract (every policy)


def test_registry_lookup_and_unknown_name() -> None:
    assert isinstance(get_tier_policy("lru"), LRUPolicy)
    assert isinstance(get_tier_policy("pgdsf"), PGDSFPolicy)
    with pytest.raises(ValueError, match="lru, pgdsf"):
        get_tier_policy("lfu")


def test_insert_access_remove_track_keys(policy: TierPolicy) -> None:
    policy.on_insert(k(1), 10, 0.1)
    policy.on_insert(k(2), 10, 0.1)
    assert len(policy) == 2 and k(1) in policy
    policy.on_access(k(1))
    assert policy.frequency(k(1)) == 2
    policy.on_remove(k(1))
    assert policy.keys() == {k(2)}
    with pytest.raises(KeyError):
        policy.on_access(k(1))


def test_double_insert_and_bad_arguments(policy: TierPolicy) -> None:
    policy.on_insert(k(1), 10, 0.1)
    with pytest.raises(RuntimeError):
        policy.on_insert(k(1), 10, 0.1)
    for size, cost, freq in [(0, 0.1, 1), (10, -1.0, 1), (10, 0.1, 0)]:
        with pytest.raises(ValueError):
            policy.on_insert(k(2), size, cost, freq)


def test_victim_is_a_candidate_and_needs_one(policy: TierPolicy) -> None:
    for i in range(5):
        policy.on_insert(k(i), 10, 0.1)
    assert policy.victim([k(3), k(4)]) in {k(3), k(4)}
    with pytest.raises(ValueError):
        policy.victim([])
    with pytest.raises(KeyError):
        policy.victim([k(99)])


def test_equal_entries_evict_in_access_order(policy: TierPolicy) -> None:
    """With equal cost, size and frequency, both policies fall back to recency."""
    for i in range(4):
        policy.on_insert(k(i), 10, 0.1)
    order = []
    alive = [k(i) for i in range(4)]
    while alive:
        v = policy.victim(alive)
        order.append(v)
        alive.remove(v)
        policy.on_remove(v, evicted=True)
    assert order == [k(0), k(1), k(2), k(3)]


def test_injected_clock_drives_ticks(policy: TierPolicy) -> None:
    now = [100.0]
    clocked = type(policy)(lambda: now[0])
    clocked.on_insert(k(1), 10, 0.1)
    now[0] = 50.0  # a clock that runs backwards makes k(2) older
    clocked.on_insert(k(2), 10, 0.1)
    assert clocked.victim([k(1), k(2)]) == k(2)


# ------------------------------------------------------------------ exact orders


def test_lru_evicts_least_recently_used() -> None:
    lru = LRUPolicy()
    for i in range(3):
        lru.on_insert(k(i), 10, float(i))
    lru.on_access(k(0))
    assert lru.victim([k(0), k(1), k(2)]) == k(1)
    lru.on_remove(k(1), evicted=True)
    assert lru.victim([k(0), k(2)]) == k(2)


def test_pgdsf_priority_formula_and_clock() -> None:
    p = PGDSFPolicy()
    p.on_insert(k(1), 100, 2.0)  # 1 * 2 / 100 = 0.02
    p.on_insert(k(2), 100, 1.0)  # 0.01
    assert p.priority(k(1)) == pytest.approx(0.02)
    p.on_access(k(2))  # 2 * 1 / 100
    assert p.priority(k(2)) == pytest.approx(0.02)
    p.on_access(k(2))
    assert p.victim([k(1), k(2)]) == k(1)
    p.on_remove(k(1), evicted=True)
    assert p.clock_value == pytest.approx(0.02)
    p.on_insert(k(3), 100, 1.0)  # clock + 0.01
    assert p.priority(k(3)) == pytest.approx(0.03)
    p.on_remove(k(3))  # not an eviction: the clock stays
    assert p.clock_value == pytest.approx(0.02)


def test_pgdsf_clock_lets_new_entries_overtake_stale_frequent_ones() -> None:
    """Each eviction raises the clock by 1/128, so after four evictions a once-used new block
    ties the five-times-used old one, and the tie goes to the older access."""
    p = PGDSFPolicy()
    p.on_insert(k(1), 128, 1.0)
    for _ in range(4):
        p.on_access(k(1))  # 5/128
    evicted = []
    for i in range(2, 8):
        p.on_insert(k(i), 128, 1.0)
        victim = p.victim([key for key in (k(1), k(i)) if key in p])
        p.on_remove(victim, evicted=True)
        evicted.append(victim)
        if victim == k(1):
            break
    assert evicted == [k(2), k(3), k(4), k(5), k(1)]
    assert p.clock_value == 5 / 128


def simulate(policy: TierPolicy, capacity: int, trace: list[int], cost: dict[int, float]) -> float:
    """Hit-weighted saved cost of a cache of ``capacity`` equal-size entries."""
    saved = 0.0
    for item in trace:
        key = k(item)
        if key in policy:
            policy.on_access(key)
            saved += cost[item]
            continue
        if len(policy) == capacity:
            policy.on_remove(policy.victim(policy.keys()), evicted=True)
        policy.on_insert(key, 100, cost[item])
    return saved


def test_pgdsf_keeps_expensive_blocks_that_lru_drops() -> None:
    # blocks 0-1 are late in long prompts (expensive); 10-29 are cheap one-off scans
    cost = {0: 5.0, 1: 5.0, **{i: 0.1 for i in range(10, 30)}}
    trace: list[int] = []
    for rnd in range(5):
        trace += [0, 1] + [10 + (rnd * 4 + j) % 20 for j in range(4)]
    pg = simulate(PGDSFPolicy(), 3, trace, cost)
    lru = simulate(LRUPolicy(), 3, trace, cost)
    assert pg == pytest.approx(40.0)  # 0 and 1 hit in rounds 2-5
    assert lru == pytest.approx(0.0)
    assert pg > lru
