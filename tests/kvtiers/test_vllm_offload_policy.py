"""PGDSFCachePolicy: PGDSF for vLLM's OffloadingConnector, alone and under vLLM's own manager."""

from __future__ import annotations

import random

import pytest
from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

from craft_rag.kvtiers.cost_model import PrefillCostModel
from craft_rag.kvtiers.keys import BlockKey
from craft_rag.kvtiers.vllm_offload_policy import PGDSFCachePolicy

MODULE = "craft_rag.kvtiers.vllm_offload_policy"
CHUNK = 16
# superlinear: the chunk ending at token 16k costs 0.1k s (deeper costs more, as attention does)
COSTS = PrefillCostModel([(16 * k, 0.05 * k * (k + 1)) for k in range(9)])


def key(name: str) -> OffloadKey:
    return make_offload_key(name.encode().ljust(8, b"."), 0)


def ctx(req: str, chain: list[OffloadKey], start: int = 0) -> ReqContext:
    """A request whose keys end at CHUNK, 2*CHUNK, ... after ``start`` chunks."""
    c = ReqContext(req_id=req)
    for i, k in enumerate(chain):
        c.set_offload_key_position(k, (start + i + 1) * CHUNK)
    return c


def store(policy: PGDSFCachePolicy, chain: list[OffloadKey], req: str, start: int = 0) -> None:
    """What the manager does for a stored, finished request: miss, insert, ready, finish."""
    c = ctx(req, chain, start)
    policy.on_store_miss(chain, c)
    for i, k in enumerate(chain):
        chunk = ChunkStatus(len(policy.chunks) + i)
        policy.insert(k, chunk)
        chunk.ref_cnt = 0
        policy.mark_evictable(k)
    policy.on_request_finished((tuple(chain),), set(chain), set(), c)
    policy._check_invariants()


def evict_names(
    policy: PGDSFCachePolicy, n: int, protected: frozenset[OffloadKey] = frozenset()
) -> list[str]:
    out = policy.evict(n, set(protected))
    assert out is not None
    policy._check_invariants()
    return [k[:-4].rstrip(b".").decode() for k, _ in out]


def policy_key(k: OffloadKey) -> BlockKey:
    return BlockKey(bytes(k))


def make_policy(capacity: int = 8) -> PGDSFCachePolicy:
    return PGDSFCachePolicy(capacity, cost_model=COSTS)


def test_cost_is_prefix_aware_from_positions() -> None:
    policy = make_policy()
    a, b = key("a"), key("b")
    store(policy, [a], "r1")
    store(policy, [b], "r2", start=6)  # ends at token 112
    assert policy.cost(a) == pytest.approx(0.1)  # T(16) - T(0)
    assert policy.cost(b) == pytest.approx(0.7)  # T(112) - T(96)
    assert policy.priority(b) > policy.priority(a)


def test_leaves_go_first_even_when_their_ancestors_cost_less() -> None:
    policy = make_policy()
    a, b, c, x = key("a"), key("b"), key("c"), key("x")
    store(policy, [a, b, c], "r1")
    store(policy, [x], "r2", start=4)  # a lone chunk deeper than c: costs more than all
    assert policy.priority(a) < policy.priority(b) < policy.priority(c) < policy.priority(x)
    assert evict_names(policy, 1) == ["c"]
    assert evict_names(policy, 2) == ["b", "a"]  # a parent joins once its last child is chosen
    assert evict_names(policy, 1) == ["x"]


def test_reuse_raises_priority_and_eviction_raises_the_clock() -> None:
    policy = make_policy()
    x, y, z = key("x"), key("y"), key("z")
    store(policy, [x], "r1")
    store(policy, [y], "r2")
    c = ctx("r3", [y])
    policy.on_request_finished(((y,),), set(), {y}, c)  # y reused once: frequency 2
    assert policy.priority(y) == pytest.approx(2 * policy.priority(x))
    assert evict_names(policy, 1) == ["x"]
    assert policy._rank.clock_value == pytest.approx(0.1)
    store(policy, [z], "r4")
    assert policy.priority(z) == pytest.approx(0.1 + 0.1)  # clock + 1 x cost


def test_protected_and_pinned_chunks_stay_and_a_short_eviction_changes_nothing() -> None:
    policy = make_policy()
    a, b, x = key("a"), key("b"), key("x")
    store(policy, [a, b], "r1")
    store(policy, [x], "r2")
    policy.mark_non_evictable(x)  # a load pinned it
    before = {k: policy.priority(k) for k in policy.chunks}
    assert policy.evict(3, set()) is None
    assert policy.evict(2, {a}) is None
    assert {k: policy.priority(k) for k in policy.chunks} == before
    policy._check_invariants()
    # protecting the leaf b leaves only its parent a: taken as a non-leaf rather than failing
    assert evict_names(policy, 1, frozenset({b})) == ["a"]
    assert policy._parent == {}
    assert evict_names(policy, 1) == ["b"]


def test_remove_after_a_failed_store_keeps_the_clock_and_clear_resets() -> None:
    policy = make_policy()
    a, b = key("a"), key("b")
    store(policy, [a, b], "r1")
    policy.remove(b)
    policy._check_invariants()
    assert policy._rank.clock_value == 0.0 and b not in policy.chunks
    policy.clear()
    assert not policy.chunks and policy._rank.clock_value == 0.0
    policy._check_invariants()


def test_touch_counts_one_use_per_key_per_call() -> None:
    policy = make_policy()
    a = key("a")
    store(policy, [a], "r1")
    policy.touch([a, a, key("missing")], ReqContext(req_id="r2"))
    assert policy.priority(a) == pytest.approx(2 * 0.1)


def test_vllm_manager_loads_it_by_module_path_and_evicts_leaf_first() -> None:
    manager = CPUOffloadingManager(
        num_chunks=3, cache_policy="PGDSFCachePolicy", cache_policy_module_path=MODULE
    )
    policy = manager._policy
    assert isinstance(policy, PGDSFCachePolicy)
    a, b, c, d = key("a"), key("b"), key("c"), key("d")

    def run(req: str, chain: list[OffloadKey], start: int = 0) -> list[OffloadKey]:
        rc = ctx(req, chain, start)
        manager.on_new_request(rc)
        out = manager.prepare_store(chain, rc)
        assert out is not None
        manager.complete_store(out.keys_to_store, rc)
        manager.on_request_finished(rc)
        policy._check_invariants()
        return out.evicted_keys

    assert run("r1", [a, b, c]) == []
    assert run("r2", [d], start=5) == [c]  # the only leaf of the chain, though a costs least
    assert run("r3", [a, b, c]) == [d]  # a, b reused (protected); d is the one left
    assert policy._rank.frequency(policy_key(a)) == 2
    assert run("r4", [d], start=5) == [c]


def test_stress_under_vllm_manager_keeps_every_invariant() -> None:
    rng = random.Random(7)
    manager = CPUOffloadingManager(
        num_chunks=6, cache_policy="PGDSFCachePolicy", cache_policy_module_path=MODULE
    )
    policy = manager._policy
    assert isinstance(policy, PGDSFCachePolicy)
    prefixes = [[key(f"p{p}c{i}") for i in range(rng.randint(1, 4))] for p in range(5)]
    evictions = 0
    for step in range(300):
        chain = prefixes[rng.randrange(5)][: rng.randint(1, 4)]
        rc = ctx(f"r{step}", chain)
        manager.on_new_request(rc)
        hits = []
        for k in chain:
            if manager.lookup(k, rc).name != "HIT":
                break
            hits.append(k)
        if hits:
            manager.prepare_load(hits, rc)
        out = manager.prepare_store(chain, rc)
        if out is not None:
            evictions += len(out.evicted_keys)
            manager.complete_store(out.keys_to_store, rc, success=rng.random() > 0.1)
        if hits:
            manager.complete_load(hits, rc)
        manager.on_request_finished(rc)
        policy._check_invariants()
        idle = {k for k, ch in policy.chunks.items() if ch.ref_cnt == 0}
        assert policy._evictable == idle
        assert len(policy.chunks) <= 6
    assert evictions > 50


def reference_victims(
    policy: PGDSFCachePolicy, n: int, protected: set[OffloadKey]
) -> list[OffloadKey] | None:
    """Leaf-first PGDSF by brute force: the cheapest leaf (chosen children count as gone),
    again and again, then non-leaves by order."""
    allowed = policy._evictable - protected
    if len(allowed) < n:
        return None

    def order(k: OffloadKey) -> tuple[float, float, bytes]:
        return policy._rank.order(policy_key(k))

    out: list[OffloadKey] = []
    while len(out) < n:
        leaves = [
            k for k in allowed if k not in out and not (policy._children.get(k, set()) - set(out))
        ]
        if not leaves:
            break
        out.append(min(leaves, key=order))
    out += sorted((k for k in allowed if k not in out), key=order)[: n - len(out)]
    return out


def test_seeded_stress_matches_the_brute_force_order() -> None:
    rng = random.Random(11)
    policy = PGDSFCachePolicy(12, cost_model=COSTS)
    universe = [[key(f"t{t}c{i}") for i in range(5)] for t in range(6)]
    for step in range(2000):
        op = rng.random()
        chain = universe[rng.randrange(6)][: rng.randint(1, 5)]
        if op < 0.3:  # a request stores the missing chunks of its chain
            c = ctx(f"r{step}", chain)
            new = [k for k in chain if k not in policy.chunks]
            policy.on_store_miss(new, c)
            for k in new:
                if len(policy.chunks) >= 12:
                    break
                chunk = ChunkStatus(step)
                policy.insert(k, chunk)
                if rng.random() < 0.9:  # the store completes
                    chunk.ref_cnt = 0
                    policy.mark_evictable(k)
                else:
                    policy.remove(k)
            reused = {k for k in chain if k in policy.chunks and rng.random() < 0.5}
            policy.on_request_finished((tuple(chain),), set(), reused, c)
        elif op < 0.4:  # pin or unpin a chunk (a load starting or ending)
            if policy.chunks:
                k = rng.choice(sorted(policy.chunks))
                if k in policy._evictable:
                    policy.mark_non_evictable(k)
                    policy.chunks[k].ref_cnt = 1
                else:
                    policy.chunks[k].ref_cnt = 0
                    policy.mark_evictable(k)
        elif op < 0.5:
            policy.touch(chain, ReqContext(req_id=f"t{step}"))
        elif op < 0.995:
            n = rng.randint(0, 4)
            protected = {k for k in policy.chunks if rng.random() < 0.2}
            expected = reference_victims(policy, n, protected) if n else []
            got = policy.evict(n, protected)
            assert (None if got is None else [k for k, _ in got]) == expected, step
        else:
            policy.clear()
        policy._check_invariants()
