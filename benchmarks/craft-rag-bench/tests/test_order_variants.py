"""The tree-order experiment harness (issue 16 item 2, ``scripts/order_variants.py``): its
``base`` variant is the library's ``tree``, every variant returns a permutation, and the
variants do change orders where they claim to (a harness whose variants all equal ``tree``
would report "no gain" for nothing)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import craft_rag.ordering as ordering
from craft_rag.chunk import Chunk, make_chunk
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.trace import read_trace

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
FIXTURE = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "squad_30.jsonl"
sys.path.insert(0, str(SCRIPTS))
import order_variant_policies as policies  # noqa: E402
import order_variants as harness  # noqa: E402


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    """The variants registered as ordering policies for one test, removed after it."""
    registry = ordering.ORDERING_POLICIES
    added = [n for n in policies.VARIANTS if n not in registry]
    for name in added:
        registry[name] = policies.VARIANTS[name]  # type: ignore[index]
    try:
        yield
    finally:
        for name in added:
            del registry[name]  # type: ignore[attr-defined]


def chunks(*ids: str) -> list[Chunk]:
    return [make_chunk(f"text of {i}", id=i) for i in ids]


def serve(policy: str, requests: list[list[Chunk]]) -> list[tuple[str, ...]]:
    planner = CraftPlanner(PlannerConfig(policy=policy, promotion="served", dedup=False))
    out = []
    for request in requests:
        plan = planner.plan(request)
        planner.commit(plan)
        out.append(tuple(c.key for c in plan.ordered))
    return out


def test_base_variant_reproduces_the_tree_policy_on_a_real_trace() -> None:
    trace = read_trace(FIXTURE)
    assert harness.fast_orders(trace, "base") == harness.fast_orders(trace, "tree")


@pytest.mark.parametrize("name", sorted(policies.VARIANTS))
def test_every_variant_returns_a_permutation(name: str) -> None:
    trace = read_trace(FIXTURE)
    policies.FUTURE[:] = [[c.key for c in r.chunks] for r in trace]
    policies.PAST[:] = [set(k) for k in policies.FUTURE]
    policies.HUB.clear()
    policies.HUB.update({c.key: len(c.key) % 7 for r in trace for c in r.chunks})
    for request, order in zip(trace, harness.fast_orders(trace, name), strict=True):
        assert sorted(order) == sorted(c.key for c in request.chunks)


def test_rank_rest_ignores_frequency_where_tree_uses_it() -> None:
    # z comes twice behind the more frequent h (never at the root); then {a, x, z} matches [a].
    requests = [chunks("a", "y"), chunks("h", "z"), chunks("h", "z", "m"), chunks("a", "x", "z")]
    assert serve("tree", requests)[3] == ("a", "z", "x")  # z: count 2, x: 0
    assert serve("rank_rest", requests)[3] == ("a", "x", "z")


def test_subtree_variant_follows_what_was_served_after_the_matched_path() -> None:
    # q was served once after [a] (below it in the tree); z, more frequent, never was.
    requests = [
        chunks("a", "y", "q"), chunks("h", "z"), chunks("h", "z", "m"), chunks("h", "z", "n"),
        chunks("a", "q", "z"),
    ]
    assert serve("tree", requests)[-1] == ("a", "z", "q")  # count first: z 3, q 1
    assert serve("subtree_64", requests)[-1] == ("a", "q", "z")


def test_oracle_reads_the_future_and_past_greedy_only_the_past() -> None:
    # Request 2 holds {p, q} besides the cached [a]: only a LATER request tells q recurs.
    requests = [chunks("a", "x"), chunks("a", "p", "q"), chunks("a", "q", "s")]
    policies.FUTURE[:] = [[c.key for c in r] for r in requests]
    policies.PAST[:] = [set(k) for k in policies.FUTURE]
    assert serve("oracle_rest", requests)[1] == ("a", "q", "p")
    assert serve("past_greedy", requests)[1] == ("a", "p", "q")


def test_hub_lead_leads_with_the_most_neighboured_new_chunk_only_without_a_match() -> None:
    # Nothing matches request 1: tree keeps rank order, hub_lead leads with q (hubness 9).
    # Request 2 matches [q, ...] under hub_lead and [p, ...] under tree; its rest keeps base's.
    requests = [chunks("p", "q", "r"), chunks("q", "s", "t")]
    policies.HUB.clear()
    policies.HUB.update({"p": 1, "q": 9, "r": 5, "s": 0, "t": 8})
    assert serve("tree", requests) == [("p", "q", "r"), ("q", "s", "t")]
    assert serve("hub_lead", requests) == [("q", "p", "r"), ("q", "s", "t")]
    assert serve("hub_rest", requests)[0] == ("q", "r", "p")
