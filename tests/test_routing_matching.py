"""The router's fast path chooses exactly what the straightforward path chooses.

``routing.matching`` against the tree's own ``match`` / ``match_subset`` on random trees with
coarse clocks (tied access times, so every tie-break is exercised), and the KV-aware policies'
pruned choice (hint index, holders by work, allocation-free matches) against an exhaustive
reference that matches every healthy replica's tree, over random trees, loads, TTFT models,
block sizes, evictions, KV events and faults.
"""

from __future__ import annotations

import random

import pytest

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.prefix_tree import ChunkPrefixTree, NodeMetadata, PrefixNode
from craft_rag.routing import (
    DISK_MEDIUM,
    RAM_MEDIUM,
    Candidate,
    ClusterView,
    RouteDecision,
    Router,
    RouterConfig,
    RouteRequest,
    TierCosts,
    TTFTModel,
)
from craft_rag.routing.matching import fixed_match_end, set_match_end
from craft_rag.routing.policies import CraftJoint, PrefixFixedOrder
from craft_rag.types import BlockHash, ChunkKey

POOL = [f"k{i}" for i in range(10)]


class Tick:
    """A clock that moves only when told: many nodes share one access time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def random_tree(rng: random.Random, clock: Tick, max_nodes: int) -> ChunkPrefixTree:
    tree = ChunkPrefixTree(max_nodes, clock=clock)
    for _ in range(rng.randint(0, 40)):
        keys = [ChunkKey(k) for k in rng.sample(POOL, rng.randint(1, 5))]
        spans = rng.random() < 0.8
        meta = None
        if spans:
            head, meta_list = rng.choice([0, 7, 32]), []
            for _ in keys:
                size = rng.randint(1, 90)
                meta_list.append(NodeMetadata(token_span=(head, head + size)))
                head += size
            meta = meta_list
        try:
            tree.insert(keys, metadata=meta)
        except ValueError:  # a span that no longer starts where an existing parent ends
            tree.insert(keys)
        if rng.random() < 0.3:
            clock.now += 1.0
        if rng.random() < 0.2:
            tree.touch(tree.match_subset(rng.sample(POOL, 3)))
    return tree


@pytest.mark.parametrize("seed", range(40))
def test_match_ends_equal_the_tree_matches(seed: int) -> None:
    rng = random.Random(seed)
    tree = random_tree(rng, Tick(), max_nodes=rng.choice([4, 16, 1000]))
    for _ in range(60):
        keys = [ChunkKey(k) for k in rng.sample(POOL, rng.randint(0, 7))]
        fixed, subset = tree.match(keys), tree.match_subset(keys)
        assert fixed_match_end(tree, keys) is (fixed.nodes[-1] if fixed.nodes else None)
        assert set_match_end(tree, frozenset(keys)) is (subset.nodes[-1] if subset.nodes else None)


def test_set_match_end_breaks_ties_like_the_tree() -> None:
    clock = Tick()
    tree = ChunkPrefixTree(clock=clock)
    tree.insert([ChunkKey("b"), ChunkKey("a")])
    tree.insert([ChunkKey("a"), ChunkKey("b")])  # same depth, same access time
    end = set_match_end(tree, frozenset({"a", "b"}))
    assert end is not None and end.path() == ("a", "b")  # the smaller key path
    clock.now = 5.0
    tree.touch(tree.match([ChunkKey("b"), ChunkKey("a")]))
    end = set_match_end(tree, frozenset({"a", "b"}))
    assert end is not None and end.path() == ("b", "a")  # then the more recent one


# ---- the pruned choice against the exhaustive one -----------------------------------------


def exhaustive(policy: object, request: RouteRequest, view: ClusterView) -> Candidate:
    """The rule as written in docs/routing.md, with no hint index and no pruning: every
    admissible healthy replica's tree matched, least (cost, index) wins, the least-loaded
    admissible replica (nothing cached) first."""
    bound = view.assign_bound()
    best = view.candidate(view.scan_least_loaded(bound), request, 0)
    for replica in view.healthy:
        tree = replica.tree(request.salt)
        if replica.load.assigned >= bound or tree is None:
            continue
        if isinstance(policy, CraftJoint):
            match = tree.match_subset(request.keys)
        else:
            match = tree.match(request.keys)
        cached = view.cached_tokens(match, request)
        if cached == 0:
            continue
        option = view.candidate(replica, request, cached, match.nodes[-1] if match.nodes else None)
        if (option.cost_s, replica.index) < (best.cost_s, best.replica.index):
            best = option
    return best


def chunks_of(rng: random.Random) -> list[Chunk]:
    names = rng.sample(POOL, rng.randint(1, 5))
    return [make_chunk(f"text {n}", id=n, num_tokens=rng.choice([None, 20, 64])) for n in names]


def serve_back(router: Router, d: RouteDecision, rng: random.Random) -> None:
    """The replica served ``d``: commit (spans known or not) while it is still up, finish."""
    replica = router.replica(d.replica)
    if replica.healthy and replica.epoch == d.epoch:
        spans = [rng.randint(1, 80) for _ in d.plan.ordered] if rng.random() < 0.8 else None
        hashes = [[BlockHash(bytes([rng.randrange(6)]))] for _ in d.plan.ordered]
        router.planner(d.replica).commit(
            d.plan, prefix_tokens=rng.choice([0, 32]), chunk_token_counts=spans,
            block_hashes=hashes,
        )
    router.finish(d)


@pytest.mark.parametrize("tiers", [False, True])
@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("policy", ["craft_joint", "prefix_fixed_order"])
def test_pruned_choice_is_the_exhaustive_choice(policy: str, seed: int, tiers: bool) -> None:
    """With ``tiers``, blocks also move between the pool and the RAM/disk tiers (and a tier
    the cost does not know), so tier-only nodes price into both choices."""
    rng = random.Random(seed)
    b = rng.choice([0.0009, 0.002, 1e-6])
    model = TTFTModel(a=rng.choice([0.0, 0.03]), b=b, c=rng.choice([0.0, b / 10, b, 2 * b]))
    clock = Tick()
    config = RouterConfig(
        load_weight=rng.choice([0.0, 1.0, 3.0]), balance_slack=rng.choice([1.0, 1.15, 10.0]),
        balance_headroom=rng.choice([1, 2, 50]), block_size=rng.choice([1, 16, 32]),
        ttft_model=model,
        tier_costs=TierCosts(ram=rng.random(), disk=rng.random()) if tiers else TierCosts(),
    )
    n = rng.choice([2, 5, 12])
    router = Router([f"r{i}" for i in range(n)], policy, config, clock=clock)
    open_: list[RouteDecision] = []
    compared = 0
    for _ in range(250):
        clock.now += rng.choice([0.0, 0.0, 1.0])
        action = rng.random()
        healthy = [r for r in router.replica_ids if router.replica(r).healthy]
        if action < 0.03 and len(healthy) > 1:
            router.mark_down(rng.choice(healthy))
        elif action < 0.06:
            router.mark_up(rng.choice(router.replica_ids))
        elif action < 0.25 and open_:
            serve_back(router, open_.pop(rng.randrange(len(open_))), rng)
        elif action < 0.30:
            router.on_blocks_removed(rng.choice(healthy), [BlockHash(bytes([rng.randrange(6)]))])
        elif tiers and action < 0.45:
            tier = rng.choice([RAM_MEDIUM, DISK_MEDIUM, None, "tape"])
            hashes = [BlockHash(bytes([rng.randrange(6)])) for _ in range(rng.randint(1, 3))]
            router.on_blocks_moved(rng.choice(healthy), hashes, tier)
        else:
            chunks = chunks_of(rng)
            prompt = rng.randint(1, 600)
            keys = tuple(dict.fromkeys(c.key for c in chunks))
            request = RouteRequest(tuple(chunks), keys, prompt)
            view = router._view()
            fast = router.policy.choose(request, view)
            slow = exhaustive(router.policy, request, view)
            assert (fast.replica.id, fast.predicted_cached_tokens, fast.cost_s) == (
                slow.replica.id, slow.predicted_cached_tokens, slow.cost_s
            )
            compared += 1
            d = router.route(chunks, prompt_tokens=prompt)
            assert d.replica == fast.replica.id
            if rng.random() < 0.5:
                serve_back(router, d, rng)
            else:
                open_.append(d)  # committed later: other requests route while it is in flight
        router._check_invariants()
    assert compared > 100


def test_pruning_skips_trees_that_cannot_win() -> None:
    """Three replicas hold the request's chunks; the idle one wins, and the busy ones (more
    queued work than any cached prefix can save) are never matched."""
    matched: list[str] = []

    class Counting(CraftJoint):
        def match_end(self, tree: ChunkPrefixTree, request: RouteRequest) -> PrefixNode | None:
            matched.append(next(r.id for r in router._order if r.tree(None) is tree))
            return super().match_end(tree, request)

    router = Router(["r0", "r1", "r2"], "craft_joint", RouterConfig(balance_slack=10.0))
    router.policy = Counting()
    chunks = [make_chunk(f"text {n}", id=n, num_tokens=64) for n in ("a", "b", "c")]
    prompt = 32 + 3 * 64 + 16
    first = [router.route(chunks, prompt_tokens=prompt) for _ in range(3)]  # nothing cached yet
    assert [d.replica for d in first] == ["r0", "r1", "r2"]  # spread by in-flight work
    for d in first:
        router.planner(d.replica).commit(d.plan, prefix_tokens=32)
        router.finish(d)
    busy = [router.route([make_chunk("x", id=f"x{i}")], prompt_tokens=3000) for i in range(2)]
    assert [d.replica for d in busy] == ["r0", "r1"]  # r2 stays idle
    matched.clear()
    d = router.route(chunks, prompt_tokens=prompt)
    assert d.replica == "r2" and d.predicted_cached_tokens == 32 + 3 * 64
    assert matched == ["r2"]  # r0 and r1 pruned unmatched
    for x in busy:
        router.finish(x)
    matched.clear()
    d2 = router.route(chunks, prompt_tokens=prompt)
    assert d2.replica == "r0" and d2.predicted_cached_tokens == 32 + 3 * 64
    assert matched == ["r0", "r1"]  # idle and tied: both matched; r2 (busy now) pruned


def test_prefix_fixed_order_matches_in_order() -> None:
    tree = ChunkPrefixTree()
    tree.insert([ChunkKey("a"), ChunkKey("b")])
    request = RouteRequest((), (ChunkKey("b"), ChunkKey("a")), 100)
    assert PrefixFixedOrder().match_end(tree, request) is None
    end = CraftJoint().match_end(tree, request)
    assert end is not None and end.path() == ("a", "b")


@pytest.mark.parametrize("seed", range(20))
def test_load_index_is_the_scan(seed: int) -> None:
    """The router's lazy-heap least-loaded index gives the O(N) scan's replica (least work,
    then fewest assigned, then lowest index, among ``assigned < bound``) after random loads,
    tied loads, faults and rejoins, through many heap rebuilds; None when none is admissible."""
    from craft_rag.routing.load_index import LoadIndex
    from craft_rag.routing.replica import Replica, ReplicaId

    rng = random.Random(seed)
    n = rng.choice([1, 2, 5, 33])
    replicas = [Replica(ReplicaId(f"r{i}"), i, RouterConfig().planner) for i in range(n)]
    index = LoadIndex(replicas, rebuild_slack=4)  # rebuilt every few dozen updates
    for _ in range(600):
        r = rng.choice(replicas)
        action = rng.random()
        if action < 0.05:
            r.go_down()
        elif action < 0.1 and not r.healthy:
            r.come_up()
        elif r.healthy:
            r.load.work_s = rng.choice([0.0, 0.5, 1.0, rng.random()])  # ties on purpose
            r.load.assigned = rng.randint(0, 6)
        index.update(r)
        index.check()
        healthy = [x for x in replicas if x.healthy]
        bound = rng.choice([float("inf"), 0.0, 1.0, 3.5, 6.0])
        view = ClusterView(healthy, lambda _: [], 0, TTFTModel(0.0, 1e-3, 0.0), 1.0, 1.0, 1, 32)
        admissible = [x for x in healthy if x.load.assigned < bound]
        expected = view.scan_least_loaded(bound) if admissible else None
        assert index.least(bound) is expected
