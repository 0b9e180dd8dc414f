"""Routing cost of tier-only KV: a prefix a replica holds only in its RAM or disk tier costs
load time (``c + (b - c) * ratio`` per token), between a pool hit and a recompute; the ratios'
validation; an unknown tier costs as the pool."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.planner import CraftPlanner
from craft_rag.routing import (
    DISK_MEDIUM,
    RAM_MEDIUM,
    RouteDecision,
    Router,
    RouterConfig,
    TierCosts,
    TTFTModel,
)
from craft_rag.routing.tier_costs import tier_penalty
from craft_rag.tree import ChunkPrefixTree, KVLocation, NodeMetadata
from craft_rag.types import BlockHash, ChunkKey

HEAD = 32
CHUNK = 64
QUESTION = 16
MODEL = TTFTModel(a=0.03, b=0.001, c=0.0001)


def make_chunks(*names: str) -> list[Chunk]:
    return [make_chunk(f"text of {n}", id=n, num_tokens=CHUNK) for n in names]


def prompt_len(chunks: list[Chunk]) -> int:
    return HEAD + CHUNK * len(chunks) + QUESTION


def block(replica: str, key: str) -> BlockHash:
    return BlockHash(f"{replica}/{key}".encode())


def make_router(
    n: int = 3, costs: TierCosts | None = None
) -> tuple[Router, dict[str, CraftPlanner]]:
    """A router over engine-owned planners (the path a real engine takes: the engine's KV
    events move its nodes between pool and tiers); returns the planners by replica."""
    owned: dict[str, CraftPlanner] = {}

    def source(name: str) -> Callable[[str | None], CraftPlanner]:
        def planner_for(salt: str | None) -> CraftPlanner:
            return owned.setdefault(name, CraftPlanner(router.planner_config))

        return planner_for

    names = [f"r{i}" for i in range(n)]
    config = RouterConfig(ttft_model=MODEL, block_size=16, tier_costs=costs or TierCosts())
    router = Router(names, "craft_joint", config, planner_sources={n: source(n) for n in names})
    return router, owned


def cache_on(router: Router, replica: str, names: str, tier: str | None = None) -> None:
    """``replica`` served ``names`` in that order (one block per chunk); then, with ``tier``,
    its pool evicted them while that tier kept them (what the engine's residency reports)."""
    chunks = make_chunks(*names.split())
    planner = router.planner(replica)
    plan = planner.plan(chunks)
    planner.commit(plan, prefix_tokens=HEAD,
                   block_hashes=[[block(replica, c.key)] for c in plan.ordered])
    if tier is not None:
        moved = router.on_blocks_moved(replica, [block(replica, c.key) for c in chunks], tier)
        assert moved == len(chunks)


def route(router: Router, names: str) -> RouteDecision:
    chunks = make_chunks(*names.split())
    d = router.route(chunks, prompt_tokens=prompt_len(chunks))
    assert router.finish(d)
    return d


def cost(prompt: int, cached: int, tier_tokens: int = 0, ratio: float = 0.0) -> float:
    base = MODEL.a + MODEL.b * (prompt - cached) + MODEL.c * cached
    return base + (MODEL.b - MODEL.c) * ratio * tier_tokens if tier_tokens else base


def test_disk_only_prefix_loses_to_the_pool() -> None:
    router, _ = make_router()
    cache_on(router, "r0", "a b c", DISK_MEDIUM)  # r0 would win a tie (lowest index)
    cache_on(router, "r1", "a b c")
    d = route(router, "c b a")
    prompt, cached = prompt_len(make_chunks("a", "b", "c")), HEAD + 3 * CHUNK
    assert (d.replica, " ".join(d.plan.keys), d.predicted_cached_tokens) == ("r1", "a b c", cached)
    assert d.predicted_cost_s == cost(prompt, cached)  # the pool's cost, bit for bit


def test_disk_only_prefix_wins_over_nothing() -> None:
    router, _ = make_router()
    cache_on(router, "r1", "a b c", DISK_MEDIUM)
    d = route(router, "a b c")
    prompt, cached = prompt_len(make_chunks("a", "b", "c")), HEAD + 3 * CHUNK
    # The chunk spans: a [32, 96), b [96, 160), c [160, 224); all on disk (the 32-token head
    # has no node, so it costs as the pool).
    expected = cost(prompt, cached, 3 * CHUNK, TierCosts().disk)
    assert (d.replica, d.predicted_cached_tokens) == ("r1", cached)
    assert d.predicted_cost_s == pytest.approx(expected, rel=1e-12)
    assert cost(prompt, cached) < d.predicted_cost_s < cost(prompt, 0)
    # The tier's load is prefill work in flight: counted in the replica's load.
    assert d.predicted_work_s == pytest.approx(expected, rel=1e-12)


def test_ram_beats_disk_and_pool_beats_ram() -> None:
    router, _ = make_router()
    cache_on(router, "r0", "a b c", DISK_MEDIUM)
    cache_on(router, "r1", "a b c", RAM_MEDIUM)
    assert route(router, "a b c").replica == "r1"
    cache_on(router, "r2", "a b c")
    assert route(router, "a b c").replica == "r2"


def test_a_longer_tier_prefix_can_beat_a_shorter_pool_one() -> None:
    """RAM costs ~0.17 of a recompute here: 3 chunks from RAM beat 1 chunk from the pool."""
    router, _ = make_router()
    cache_on(router, "r0", "a")
    cache_on(router, "r1", "a b c", RAM_MEDIUM)
    assert route(router, "a b c").replica == "r1"


def test_back_in_the_pool_costs_as_the_pool() -> None:
    router, _ = make_router()
    cache_on(router, "r0", "a b c")
    cache_on(router, "r1", "a b c", DISK_MEDIUM)
    blocks = [block("r1", k) for k in ("a", "b", "c")]
    assert router.on_blocks_moved("r1", blocks, None) == 3  # loaded back into r1's pool
    d = route(router, "a b c")
    assert d.replica == "r0"  # a tie again: lowest index
    assert d.predicted_cost_s == cost(prompt_len(make_chunks("a", "b", "c")), HEAD + 3 * CHUNK)


def test_unknown_tier_costs_as_the_pool() -> None:
    router, _ = make_router()
    cache_on(router, "r1", "a b c", "tape")  # not a medium the router knows
    d = route(router, "a b c")
    assert d.predicted_cost_s == cost(prompt_len(make_chunks("a", "b", "c")), HEAD + 3 * CHUNK)


def test_ratios_set_the_price() -> None:
    """A free tier (ratio 0) costs as the pool; a ratio of 1 prices the tier's tokens as a
    recompute (only the 32-token head, which no node covers, stays a pool read)."""
    prompt, cached = prompt_len(make_chunks("a", "b", "c")), HEAD + 3 * CHUNK
    router, _ = make_router(costs=TierCosts(ram=0.5, disk=0.0))
    cache_on(router, "r1", "a b c", DISK_MEDIUM)
    d = route(router, "a b c")
    assert (d.replica, d.predicted_cost_s) == ("r1", cost(prompt, cached))
    router, _ = make_router(costs=TierCosts(ram=1.0, disk=1.0))
    cache_on(router, "r0", "a b c", RAM_MEDIUM)
    d = route(router, "a b c")
    assert d.replica == "r0"
    assert d.predicted_cost_s == pytest.approx(cost(prompt, HEAD), rel=1e-12)


def test_events_from_a_replica_that_is_down_are_ignored() -> None:
    router, _ = make_router()
    cache_on(router, "r1", "a b c")
    router.mark_down("r1")
    assert router.on_blocks_moved("r1", [block("r1", "a")], DISK_MEDIUM) == 0


def test_tier_penalty_counts_only_the_cached_part_of_each_tier_node() -> None:
    tree = ChunkPrefixTree()
    spans = [(32, 96), (96, 160), (160, 224)]
    keys = [ChunkKey(k) for k in ("a", "b", "c")]
    end = tree.insert(keys, metadata=[NodeMetadata(token_span=s) for s in spans]).nodes[-1]
    costs = TierCosts(ram=0.25, disk=0.5)
    assert tier_penalty(end, 208, costs) == 0.0  # every node in the pool
    end.location = KVLocation(tier=DISK_MEDIUM)  # c: [160, 208) of it is cached
    end.parent.location = KVLocation(tier=RAM_MEDIUM)  # type: ignore[union-attr]  # b: all
    assert tier_penalty(end, 208, costs) == 0.5 * 48 + 0.25 * 64
    assert tier_penalty(None, 208, costs) == 0.0
    assert tier_penalty(end, 0, costs) == 0.0
    spanless = ChunkPrefixTree()
    last = spanless.insert(keys[:2]).nodes[-1]
    last.location = KVLocation(tier=RAM_MEDIUM)
    assert tier_penalty(last, 100, costs) == 0.25 * 50  # an equal share per node


@pytest.mark.parametrize("field", ["ram", "disk"])
@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf, 1.5, True, "0.2", None])
def test_bad_ratios_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"TierCosts.{field}"):
        TierCosts(**{field: value})  # type: ignore[arg-type]


def test_ratio_bounds_are_inclusive_and_defaults_are_the_measured_ones() -> None:
    assert TierCosts(ram=0, disk=1).ratio(DISK_MEDIUM) == 1
    costs = TierCosts()
    assert (costs.ratio(RAM_MEDIUM), costs.ratio(DISK_MEDIUM)) == (0.171, 0.270)
    assert costs.ratio("device") is None and costs.ratio("GPU") is None
    # docs/kv-tiers.md "Measured": midpoints of the hit and recompute TTFT ranges.
    assert costs.ram == pytest.approx(((0.27 + 0.39) / 2) / ((1.85 + 2.02) / 2), abs=5e-4)
    assert costs.disk == pytest.approx(((1.2 + 1.9) / 2) / ((5.5 + 6.0) / 2), abs=5e-4)


def test_router_config_refuses_a_bare_number_for_tier_costs() -> None:
    with pytest.raises(ValueError, match="tier_costs"):
        RouterConfig(tier_costs=0.2)  # type: ignore[arg-type]


def test_router_owned_planners_hear_tier_moves_too() -> None:
    """Without planner_sources (the simulator's path) the router's own trees take the moves."""
    router = Router(["r0", "r1"], "craft_joint", RouterConfig(ttft_model=MODEL, block_size=16))
    chunks = make_chunks("a", "b", "c")
    d = router.route(chunks, prompt_tokens=prompt_len(chunks))
    router.planner(d.replica).commit(
        d.plan, prefix_tokens=HEAD, block_hashes=[[block("r0", c.key)] for c in d.plan.ordered])
    router.finish(d)
    assert router.on_blocks_moved("r0", [block("r0", "c")], DISK_MEDIUM) == 1
    again = router.route(chunks, prompt_tokens=prompt_len(chunks))
    prompt, cached = prompt_len(chunks), HEAD + 3 * CHUNK
    assert again.replica == "r0"
    assert again.predicted_cost_s == pytest.approx(
        cost(prompt, cached, CHUNK, TierCosts().disk), rel=1e-12)
    router.finish(again)
    router._check_invariants()
