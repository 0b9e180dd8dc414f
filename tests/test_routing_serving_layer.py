"""The serving-layer policies (``prefix_blocks``, ``prefix_craft_order``): Dynamo-style block
scoring of the prompt as given (exact prefix, load term, ties, no assignment bound) and, in
the simulator, the application's planner that orders prompts before they reach the router."""

from __future__ import annotations

from dataclasses import replace

import pytest

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.routing import ROUTING_POLICIES, RouteDecision, Router, RouterConfig
from craft_rag.routing.policies import get_routing_policy
from craft_rag.routing.simulator import SimConfig, prepare_trace, simulate
from craft_rag.tokenizer import HashingTokenizer
from craft_rag.trace import TraceRequest

HEAD = 32  # tokens before the first chunk
CHUNK = 64  # tokens per chunk (two blocks of 32)
QUESTION = 16
BLOCK = 32


def make_chunks(*names: str) -> list[Chunk]:
    return [make_chunk(f"text of {n}", id=n, num_tokens=CHUNK) for n in names]


def prompt_len(n_chunks: int) -> int:
    return HEAD + CHUNK * n_chunks + QUESTION


def make_router(n: int = 2, policy: str = "prefix_craft_order") -> Router:
    return Router([f"r{i}" for i in range(n)], policy, RouterConfig(block_size=BLOCK))


def serve(router: Router, names: str, *, finish: bool = True, tokens: int | None = None,
          commit: bool = True) -> RouteDecision:
    """Route ``names`` in this order, commit as if the replica cached the whole prompt."""
    chunks = make_chunks(*names.split())
    d = router.route(chunks, prompt_tokens=tokens or prompt_len(len(chunks)))
    if commit:
        router.planner(d.replica, None).commit(d.plan, prefix_tokens=HEAD)
    if finish:
        assert router.finish(d)
    return d


def test_only_the_serving_layer_models_take_ordered_prompts_from_the_app() -> None:
    apps = {name: get_routing_policy(name).app_ordering for name in ROUTING_POLICIES}
    assert apps == {"round_robin": None, "least_loaded": None, "prefix_fixed_order": None,
                    "craft_joint": None, "prefix_blocks": None, "prefix_craft_order": "tree"}
    assert get_routing_policy("prefix_craft_order").ordering == "retriever"


@pytest.mark.parametrize("policy", ["prefix_blocks", "prefix_craft_order"])
def test_the_prompt_is_matched_and_served_as_given(policy: str) -> None:
    router = make_router(2, policy)
    assert serve(router, "a b c").replica == "r0"
    # The same set in another order has no exact prefix on r0: a cold request, placed by the
    # tie-break (fewest assigned) and served in the order given (no reordering by the router).
    other = serve(router, "c b a")
    assert (other.replica, other.plan.keys, other.predicted_cached_tokens) == (
        "r1", ("c", "b", "a"), 0
    )
    again = serve(router, "a b x")
    assert (again.replica, again.predicted_cached_tokens) == ("r0", HEAD + 2 * CHUNK)


def test_craft_joint_takes_the_set_where_the_serving_layer_cannot() -> None:
    router = make_router(2, "craft_joint")
    serve(router, "a b c")
    d = serve(router, "c b a")
    assert (d.replica, d.plan.keys) == ("r0", ("a", "b", "c"))


def test_cold_ties_go_to_the_fewest_assigned_then_the_lowest_index() -> None:
    router = make_router(3)
    assert [serve(router, f"k{i}").replica for i in range(4)] == ["r0", "r1", "r2", "r0"]


def test_load_term_in_blocks_against_the_cached_prefix() -> None:
    # "a b c" cached on r0: its 240-token prompt has 7 whole cached blocks there, so
    # cost(r0) = (7.5 - 7) + active_blocks(r0) and cost(r1) = 7.5 + active_blocks(r1).
    router = make_router(2)
    serve(router, "a b c")
    # 224 prompt tokens (7 blocks) in flight on r0: a request on "a" (3 cached blocks) goes there.
    hold = serve(router, "a", finish=False, tokens=224)
    assert hold.replica == "r0"
    # Exact tie 7.5 = 7.5: the fewest assigned (r1) wins (not committed: r1 stays empty).
    tie = serve(router, "a b c", finish=False, commit=False)
    assert tie.replica == "r1"
    router.finish(tie)
    router.finish(hold)
    # One block less in flight on r0 -> r0 by exactly one block.
    hold = serve(router, "a", finish=False, tokens=192)
    assert (hold.replica, serve(router, "a b c", commit=False).replica) == ("r0", "r0")
    # One block more -> r1.
    router.finish(hold)
    hold = serve(router, "a", finish=False, tokens=256)
    assert (hold.replica, serve(router, "a b c").replica) == ("r0", "r1")


def test_no_assignment_bound_a_hot_prefix_stays_on_its_holder() -> None:
    """Neither llm-d nor Dynamo bounds assignments: an idle holder keeps a hot prefix, where
    craft_joint's bound spills it to the other replica."""
    serving, ours = make_router(2), make_router(2, "craft_joint")
    assert {serve(serving, "a b c").replica for _ in range(12)} == {"r0"}
    assert {serve(ours, "a b c").replica for _ in range(12)} == {"r0", "r1"}


def test_decisions_report_predicted_seconds_like_every_policy() -> None:
    router = make_router(2)
    model = router.config.ttft_model
    cold = serve(router, "a b c")
    assert cold.predicted_cost_s == pytest.approx(model.predict(prompt_len(3), 0))
    warm = serve(router, "a b c")
    cached = 7 * BLOCK
    assert warm.predicted_cached_tokens == cached
    assert warm.predicted_cost_s == pytest.approx(model.predict(prompt_len(3) - cached, cached))


# ---- simulator --------------------------------------------------------------------------


def shuffled_trace() -> list[TraceRequest]:
    """Four chunk sets, each asked six times with its chunks in a different retriever order."""
    pool = [make_chunk(f"Passage {i} says something about subject {i} at length.", id=f"p{i}")
            for i in range(12)]
    orders = [(0, 1, 2), (2, 0, 1), (1, 2, 0), (0, 2, 1), (2, 1, 0), (1, 0, 2)]
    out: list[TraceRequest] = []
    for rep, order in enumerate(orders):
        for s in range(4):
            chunks = tuple(pool[3 * s + j] for j in order)
            out.append(TraceRequest(id=f"s{s}#{rep}", query=f"Question {rep} on set {s}?",
                                    chunks=chunks))
    return out


def test_the_app_planner_orders_prompts_for_the_serving_layer() -> None:
    prepared = prepare_trace(shuffled_trace(), HashingTokenizer())
    rows = {
        policy: simulate(prepared, SimConfig(replicas=2, policy=policy, capacity_tokens=8192,
                                             load=0.2), check_invariants=True)
        for policy in ("prefix_blocks", "prefix_craft_order", "craft_joint")
    }
    # Retriever order: a set is matched only when it comes back with the same first chunk(s).
    # App-ordered: every repeat of a set is sent in one order and finds it cached.
    assert rows["prefix_craft_order"].cached_token_fraction > (
        1.5 * rows["prefix_blocks"].cached_token_fraction
    )
    assert rows["prefix_craft_order"].predicted_cached_fraction == pytest.approx(
        rows["prefix_craft_order"].cached_token_fraction, abs=0.02
    )


def test_one_replica_with_the_app_planner_is_the_single_engine() -> None:
    """N = 1 without KV events: the app planner (tree order, reuse reports) sees exactly what
    round-robin's replica planner sees, so the served prompts and cached tokens are equal."""
    prepared = prepare_trace(shuffled_trace(), HashingTokenizer())
    config = SimConfig(replicas=1, capacity_tokens=512, load=0.5, kv_events=False)
    app = simulate(prepared, replace(config, policy="prefix_craft_order"))
    single = simulate(prepared, replace(config, policy="round_robin"))
    assert app.cached_token_fraction == single.cached_token_fraction
    assert 0.0 < app.cached_token_fraction < 1.0  # evictions happened, and reuse
