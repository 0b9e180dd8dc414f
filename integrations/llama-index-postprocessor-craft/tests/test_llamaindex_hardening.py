"""Issue 11 items 1, 3, 10, 12, 13 for the LlamaIndex postprocessor (no engine).

* a postprocessor that only has a conversation id reorders and never drops (the trap);
* one rule for conversation ids (``0`` is the conversation ``"0"``);
* one-shot iterables are read once; nothing the caller passed is merged or lost.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from uuid import UUID

import pytest
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index.postprocessor.craft import CraftReorderPostprocessor
from llama_index.postprocessor.craft.nodes import validate_conversation_id
from llama_index.postprocessor.craft.testing import make_node, make_nodes, node_ids

# ---- the trap: a conversation id alone never drops -------------------------------------------


def test_postprocess_mode_with_a_conversation_id_reorders_and_never_drops() -> None:
    pp = CraftReorderPostprocessor(conversation_id="user-1")
    assert not pp.deduplicates
    for ids in ([1, 2], [2, 3], [1, 2]):
        result = pp.reorder(make_nodes(ids))
        assert sorted(node_ids(result.nodes)) == sorted(f"n{i}" for i in ids)
        assert result.removed_duplicates == ()
        assert result.plan is not None and result.plan.conversation_id is None


def test_dedup_needs_the_explicit_flag_or_the_engine_mode() -> None:
    pp = CraftReorderPostprocessor(conversation_id="user-1", keeps_earlier_chunks=True)
    pp.reorder(make_nodes([1, 2]))
    assert node_ids(pp.reorder(make_nodes([1, 3])).nodes) == ["n3"]
    engine_mode = CraftReorderPostprocessor(commit_mode="engine")
    assert engine_mode.deduplicates  # the engine commits only plans it served append-only
    off = CraftReorderPostprocessor(commit_mode="engine", keeps_earlier_chunks=False)
    assert not off.deduplicates


def test_keeps_earlier_chunks_must_be_a_bool_or_none() -> None:
    with pytest.raises(ValueError, match="keeps_earlier_chunks must be True, False or None"):
        CraftReorderPostprocessor(keeps_earlier_chunks="yes")


# ---- one rule for conversation ids -------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [("0", "0"), ("u-3", "u-3"), (None, None)])
def test_one_rule_for_conversation_ids(value: Any, expected: str | None) -> None:
    assert validate_conversation_id(value) == expected
    pp = CraftReorderPostprocessor(conversation_id=value, keeps_earlier_chunks=True)
    assert pp.conversation_id == expected
    result = CraftReorderPostprocessor(keeps_earlier_chunks=True).reorder(
        make_nodes([1]), conversation_id=value
    )
    assert result.plan is not None and result.plan.conversation_id == expected


@pytest.mark.parametrize("bad", [0, True, "", 1.5, ["c"], UUID(int=3)])
def test_bad_conversation_ids_are_value_errors(bad: Any) -> None:
    """``0`` is never "no conversation": it is refused (pass "0"), as in the core."""
    with pytest.raises(ValueError, match="conversation_id"):
        CraftReorderPostprocessor(conversation_id=bad)
    with pytest.raises(ValueError, match="conversation_id"):
        CraftReorderPostprocessor().reorder(make_nodes([1]), conversation_id=bad)


# ---- one-shot iterables, nothing lost ----------------------------------------------------------


def test_a_generator_of_nodes_is_read_once() -> None:
    def gen() -> Iterator[NodeWithScore]:
        yield from make_nodes([1, 2, 3])

    result = CraftReorderPostprocessor().reorder(gen())
    assert sorted(node_ids(result.nodes)) == ["n1", "n2", "n3"]


def test_a_bad_item_changes_nothing() -> None:
    pp = CraftReorderPostprocessor()
    before = pp.planner.to_json()
    with pytest.raises(ValueError, match="NodeWithScore"):
        pp.reorder([*make_nodes([1, 2]), "not a node"])  # type: ignore[list-item]
    assert pp.planner.to_json() == before


def test_metadata_only_nodes_pass_through_in_order() -> None:
    items = [
        NodeWithScore(node=TextNode(id_=f"m{i}", text="", metadata={"i": i}), score=1.0)
        for i in range(3)
    ]
    result = CraftReorderPostprocessor().reorder([*items, make_node(1)])
    assert node_ids(result.nodes) == ["n1", "m0", "m1", "m2"]
    assert result.passthrough == tuple(items)


def test_lone_surrogates_name_the_node() -> None:
    with pytest.raises(ValueError, match=r"nodes\[1\] \('nbad'\) text holds a lone surrogate"):
        CraftReorderPostprocessor().reorder([make_node(1), make_node("bad", "x \ud800")])
