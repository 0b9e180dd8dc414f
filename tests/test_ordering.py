"""Ordering policies (paper §4.2 "Chunk Permutation"): one contract suite over every policy,
exact expected orders, and the `tree` policy's guarantee over random traces."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from craft_rag.access_table import ChunkAccessTable
from craft_rag.chunk import Chunk, make_chunk
from craft_rag.ordering import (
    DEFAULT_POLICY,
    ORDERING_POLICIES,
    OrderingContext,
    RetrieverOrder,
    get_policy,
)
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.prefix_tree import ChunkPrefixTree
from craft_rag.testing import FakeClock
from craft_rag.types import ChunkKey


def make_chunks(*names: str) -> list[Chunk]:
    return [make_chunk(f"text of {n}", id=n) for n in names]


def make_context(
    history: list[list[str]] | None = None,
    paths: list[list[str]] | None = None,
    window: int | None = None,
) -> OrderingContext:
    table = ChunkAccessTable(window=window)
    for request in history or []:
        table.record([ChunkKey(k) for k in request])
    tree = ChunkPrefixTree(1000, clock=FakeClock())
    for path in paths or []:
        tree.insert([ChunkKey(k) for k in path])
    return OrderingContext(table, tree)


def order_names(policy: str, names: list[str], context: OrderingContext) -> list[str]:
    return [c.key for c in get_policy(policy).order(make_chunks(*names), context)]


# ---- registry -----------------------------------------------------------------------------------


def test_registry_holds_the_three_policies() -> None:
    assert set(ORDERING_POLICIES) == {"retriever", "frequency", "tree"}
    assert DEFAULT_POLICY in ORDERING_POLICIES


def test_unknown_policy_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match="frequency") as info:
        get_policy("random")
    assert "'random'" in str(info.value) and "tree" in str(info.value)


# ---- contract suite: every policy ----------------------------------------------------------------

ALL_POLICIES = sorted(ORDERING_POLICIES)
NAMES = [f"c{i}" for i in range(8)]
history_strategy = st.lists(st.lists(st.sampled_from(NAMES), max_size=5), max_size=8)
paths_strategy = st.lists(
    st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True), max_size=6
)
request_strategy = st.lists(st.sampled_from(NAMES), max_size=8, unique=True)


@pytest.mark.parametrize("name", ALL_POLICIES)
class TestPolicyContract:
    def test_name_matches_registry_key_and_objects_are_new(self, name: str) -> None:
        policy = get_policy(name)
        assert policy.name == name
        assert get_policy(name) is not policy

    def test_empty_request(self, name: str) -> None:
        assert get_policy(name).order([], make_context()) == []

    def test_single_chunk(self, name: str) -> None:
        chunks = make_chunks("only")
        assert get_policy(name).order(chunks, make_context([["only"]], [["only"]])) == chunks

    @settings(max_examples=60, deadline=None)
    @given(history=history_strategy, paths=paths_strategy, request=request_strategy)
    def test_returns_a_permutation_of_its_input_and_reads_only(
        self, name: str, history: list[list[str]], paths: list[list[str]], request: list[str]
    ) -> None:
        context = make_context(history, paths, window=4)
        before = (
            json.dumps(context.access_table.to_json()),
            json.dumps(context.prefix_tree.to_json()),
        )
        chunks = make_chunks(*request)
        out = get_policy(name).order(chunks, context)
        assert isinstance(out, list)
        assert sorted(map(id, out)) == sorted(map(id, chunks))  # the same objects, each once
        again = get_policy(name).order(chunks, context)
        assert [c.key for c in again] == [c.key for c in out]  # deterministic
        after = (
            json.dumps(context.access_table.to_json()),
            json.dumps(context.prefix_tree.to_json()),
        )
        assert after == before

    def test_does_not_mutate_the_input_sequence(self, name: str) -> None:
        chunks = make_chunks("b", "a", "c")
        snapshot = list(chunks)
        get_policy(name).order(chunks, make_context([["c"], ["c", "a"]], [["a", "b"]]))
        assert chunks == snapshot

    def test_works_on_a_tuple_and_10000_chunks(self, name: str) -> None:
        chunks = tuple(make_chunk(id=f"k{i}") for i in range(10_000))
        context = make_context([[f"k{i}" for i in range(0, 10_000, 3)]], [["k5", "k7"]])
        out = get_policy(name).order(chunks, context)
        assert sorted(c.key for c in out) == sorted(c.key for c in chunks)


# ---- exact orders --------------------------------------------------------------------------------


def test_retriever_keeps_the_order() -> None:
    context = make_context([["c", "c"], ["c"]], [["c", "a"]])
    assert order_names("retriever", ["b", "a", "c"], context) == ["b", "a", "c"]
    assert RetrieverOrder().order((), context) == []


def test_frequency_sorts_by_count_then_key() -> None:
    context = make_context([["b", "a"], ["b", "c"]])  # b:2, a:1, c:1, d:0
    assert order_names("frequency", ["d", "c", "a", "b"], context) == ["b", "a", "c", "d"]


def test_frequency_ties_are_broken_by_key_never_by_retriever_rank() -> None:
    context = make_context([["x", "y", "z"]])  # all tied at 1
    assert order_names("frequency", ["z", "x", "y"], context) == ["x", "y", "z"]
    assert order_names("frequency", ["y", "z", "x"], context) == ["x", "y", "z"]
    assert order_names("frequency", ["q", "p"], make_context()) == ["p", "q"]  # all zero


def test_paper_section_3_1_reordering_of_request_2() -> None:
    # R1 = [C1, C4, C5, C6, C7] was served; R2 = [C1, C2, C3, C4, C5] becomes
    # R2' = [C1, C4, C5, C2, C3], aligning C1, C4, C5 at the shared prefix.
    context = make_context([["C1", "C4", "C5", "C6", "C7"]])
    assert order_names("frequency", ["C1", "C2", "C3", "C4", "C5"], context) == [
        "C1", "C4", "C5", "C2", "C3",
    ]


def test_paper_section_4_2_permutation_example() -> None:
    # {C1, C2, C3} and {C2, C3, C4} share no prefix; with C2, C3 more frequent both start
    # [C2, C3].
    context = make_context([["C2", "C3"], ["C2", "C3", "C9"]])
    first = order_names("frequency", ["C1", "C2", "C3"], context)
    second = order_names("frequency", ["C2", "C3", "C4"], context)
    assert first[:2] == second[:2] == ["C2", "C3"]
    assert first == ["C2", "C3", "C1"] and second == ["C2", "C3", "C4"]


def test_tree_puts_the_cached_path_first_then_frequency() -> None:
    context = make_context(
        history=[["z", "w"], ["z"], ["z"]],  # z:3, w:1, x:0, y:0
        paths=[["x", "y"]],
    )
    assert order_names("tree", ["w", "z", "y", "x"], context) == ["x", "y", "z", "w"]
    assert order_names("frequency", ["w", "z", "y", "x"], context) == ["z", "w", "x", "y"]


def test_tree_uses_a_set_match_not_only_the_frequency_head() -> None:
    context = make_context(history=[["d"], ["d"]], paths=[["a", "b", "c"], ["d"]])
    # The frequency head is d, but [a, b, c] is the longest cached path inside the set.
    assert order_names("tree", ["d", "c", "b", "a"], context) == ["a", "b", "c", "d"]


def test_tree_without_a_cached_path_equals_frequency() -> None:
    context = make_context(history=[["b"], ["b", "c"]], paths=[["q", "r"]])
    names = ["a", "c", "b"]
    assert order_names("tree", names, context) == order_names("frequency", names, context)
    assert order_names("tree", names, context) == ["b", "c", "a"]


def test_tree_only_uses_a_path_whose_chunks_are_all_requested() -> None:
    context = make_context(paths=[["a", "b", "c"]])
    assert order_names("tree", ["c", "a"], context) == ["a", "c"]  # only [a] is usable


def test_tree_breaks_frequency_ties_by_retriever_rank() -> None:
    # Issue 16: the new branch keeps the retriever's rank among equally frequent chunks (a
    # reworded question keeps its top-ranked chunks); frequency still comes first.
    context = make_context(history=[["c"]], paths=[["q"]])
    assert order_names("tree", ["b", "a", "c", "d"], context) == ["c", "b", "a", "d"]
    assert order_names("tree", ["d", "a", "b"], context) == ["d", "a", "b"]
    assert order_names("frequency", ["b", "a", "c", "d"], context) == ["c", "a", "b", "d"]


def test_tree_gives_a_served_set_its_cached_order_whatever_the_retriever_order() -> None:
    context = make_context(paths=[["b", "a", "c"]])
    assert order_names("tree", ["c", "a", "b"], context) == ["b", "a", "c"]
    assert order_names("tree", ["a", "b", "c"], context) == ["b", "a", "c"]


@pytest.mark.parametrize("name", ["frequency"])
@settings(max_examples=40, deadline=None)
@given(
    history=history_strategy,
    paths=paths_strategy,
    request=request_strategy,
    data=st.data(),
)
def test_set_based_policies_ignore_the_retriever_order(
    name: str,
    history: list[list[str]],
    paths: list[list[str]],
    request: list[str],
    data: st.DataObject,
) -> None:
    # The same chunk set gets the same order whatever order the retriever returned it in
    # (``tree`` only for a set it served before: its new branch follows retriever rank).
    context = make_context(history, paths)
    shuffled = data.draw(st.permutations(request))
    assert order_names(name, request, context) == order_names(name, list(shuffled), context)


# ---- the tree policy never aligns fewer chunks than the retriever order --------------------------

trace_strategy = st.lists(
    st.lists(st.sampled_from(NAMES), min_size=1, max_size=6, unique=True), min_size=1, max_size=25
)


@settings(max_examples=100, deadline=None)
@given(
    trace=trace_strategy,
    driver=st.sampled_from(ALL_POLICIES),
    promotion=st.sampled_from(["threshold", "served"]),
    max_nodes=st.integers(min_value=1, max_value=12),
    window=st.integers(min_value=1, max_value=6),
    data=st.data(),
)
def test_tree_never_aligns_fewer_chunks_than_the_retriever_order(
    trace: list[list[str]],
    driver: str,
    promotion: str,
    max_nodes: int,
    window: int,
    data: st.DataObject,
) -> None:
    planner = CraftPlanner(
        PlannerConfig(
            policy=driver,
            promotion=promotion,
            max_tree_nodes=max_nodes,
            window=window,
            threshold=data.draw(st.integers(1, 3)),
        ),
        clock=FakeClock(),
    )
    tree_policy, retriever = get_policy("tree"), get_policy("retriever")
    for request in trace:
        chunks = make_chunks(*request)
        context = OrderingContext(planner.access_table, planner.prefix_tree)
        tree_order = [c.key for c in tree_policy.order(chunks, context)]
        retriever_order = [c.key for c in retriever.order(chunks, context)]
        tree_aligned = planner.prefix_tree.match(tree_order).length
        retriever_aligned = planner.prefix_tree.match(retriever_order).length
        assert tree_aligned >= retriever_aligned
        assert tree_aligned == planner.prefix_tree.match_subset(retriever_order).length
        plan = planner.plan(chunks)
        reused = data.draw(st.integers(0, plan.matched_chunks))  # the engine may have evicted
        planner.commit(plan, reused_chunks=reused)
        planner._check_invariants()
