"""CraftReorderPostprocessor: order, dedup reporting, bad input, events, commit modes."""

from __future__ import annotations

import pytest
from llama_index.core.bridge.pydantic import AnyUrl
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import (
    Document,
    ImageNode,
    MediaResource,
    NodeWithScore,
    QueryBundle,
    TextNode,
)
from llama_index.postprocessor.craft import (
    CraftCommitEvent,
    CraftReorderEndEvent,
    CraftReorderPostprocessor,
    CraftReorderStartEvent,
)
from llama_index.postprocessor.craft.testing import EventRecorder, make_node, make_nodes, node_ids

from craft_rag import CraftPlanner, PlannerConfig


def test_is_a_node_postprocessor_with_typed_fields() -> None:
    pp = CraftReorderPostprocessor(policy="frequency", window=50, threshold=3)
    assert isinstance(pp, BaseNodePostprocessor)
    assert CraftReorderPostprocessor.class_name() == "CraftReorderPostprocessor"
    assert pp.planner.config.policy == "frequency"
    assert pp.planner.config.window == 50
    assert pp.planner.config.threshold == 3
    dumped = pp.to_dict()
    assert dumped["policy"] == "frequency" and dumped["key_source"] == "node_id"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "random"}, "choose one of"),
        ({"threshold": 0}, "threshold must be >= 1"),
        ({"window": 0}, "window must be None"),
        ({"key_source": "title"}, "key_source"),
        ({"commit_mode": "never"}, "commit_mode"),
    ],
)
def test_bad_settings_raise(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CraftReorderPostprocessor(**kwargs)  # type: ignore[arg-type]


def test_shared_planner_supplies_settings_and_rejects_conflicts() -> None:
    planner = CraftPlanner(PlannerConfig(policy="frequency", window=10, threshold=1))
    pp = CraftReorderPostprocessor(planner=planner)
    assert (pp.policy, pp.window, pp.threshold) == ("frequency", 10, 1)
    assert pp.planner is planner
    assert CraftReorderPostprocessor(planner=planner, policy="frequency").planner is planner
    with pytest.raises(ValueError, match="disagrees with the shared planner"):
        CraftReorderPostprocessor(planner=planner, policy="tree")
    with pytest.raises(ValueError, match="CraftPlanner"):
        CraftReorderPostprocessor(planner="not a planner")  # type: ignore[arg-type]


def test_frequent_chunks_move_to_the_front_exactly() -> None:
    pp = CraftReorderPostprocessor(policy="frequency")
    assert node_ids(pp.postprocess_nodes(make_nodes([3, 1]))) == ["n1", "n3"]  # tie: by key
    assert node_ids(pp.postprocess_nodes(make_nodes([1, 9]))) == ["n1", "n9"]
    # n1 seen twice, n3 once, n7 never: frequency order, ties by key.
    out = pp.postprocess_nodes(make_nodes([7, 3, 1]))
    assert node_ids(out) == ["n1", "n3", "n7"]


def test_tree_policy_gives_a_served_chunk_set_its_cached_order_back() -> None:
    pp = CraftReorderPostprocessor()  # tree policy, served promotion
    first = node_ids(pp.postprocess_nodes(make_nodes([4, 2, 8])))
    again = node_ids(pp.postprocess_nodes(make_nodes([8, 4, 2])))
    assert again == first
    assert pp.planner.stats.reused_chunks == 3


def test_returns_the_same_node_objects_unmodified() -> None:
    nodes = make_nodes([2, 1])
    before = [n.model_dump() for n in nodes]
    out = CraftReorderPostprocessor().postprocess_nodes(nodes)
    assert {id(n) for n in out} == {id(n) for n in nodes}
    assert [n.model_dump() for n in nodes] == before


async def test_sync_and_async_agree() -> None:
    planner_a = CraftPlanner(clock=lambda: 0.0)
    planner_b = CraftPlanner(clock=lambda: 0.0)
    sync_pp = CraftReorderPostprocessor(planner=planner_a)
    async_pp = CraftReorderPostprocessor(planner=planner_b)
    for ids in ([5, 2, 9], [9, 3, 5], [3, 2, 5, 9]):
        s = node_ids(sync_pp.postprocess_nodes(make_nodes(ids), query_str="q"))
        a = node_ids(await async_pp.apostprocess_nodes(make_nodes(ids), query_str="q"))
        assert s == a
    assert planner_a.to_json() == planner_b.to_json()


def test_conversation_dedup_drops_and_reports_earlier_chunks() -> None:
    pp = CraftReorderPostprocessor(conversation_id="chat-1", keeps_earlier_chunks=True)
    pp.postprocess_nodes(make_nodes([1, 2]))
    result = pp.reorder(make_nodes([2, 3]))
    assert node_ids(result.nodes) == ["n3"]
    assert node_ids(result.removed_duplicates) == ["n2"]
    assert result.plan is not None and result.plan.turn == 2
    # Per-call override: another conversation sees everything.
    other = pp.reorder(make_nodes([2, 3]), conversation_id="chat-2")
    assert sorted(node_ids(other.nodes)) == ["n2", "n3"]


def test_empty_node_list_plans_nothing() -> None:
    pp = CraftReorderPostprocessor()
    result = pp.reorder([])
    assert result.nodes == [] and result.plan is None and not result.committed
    assert pp.planner.stats.plans == 0


def test_non_text_and_empty_nodes_pass_through_at_the_end() -> None:
    image = NodeWithScore(node=ImageNode(id_="img", image_url="https://example.com/x.png"))
    empty = NodeWithScore(node=TextNode(id_="empty", text="   "))
    media_doc = NodeWithScore(
        node=Document(
            id_="doc-img",
            text="caption",
            image_resource=MediaResource(url=AnyUrl("https://e.com/x.png")),
        )
    )
    text_doc = NodeWithScore(node=Document(id_="doc", text="a plain document"))
    nodes = [image, make_node(1), empty, media_doc, text_doc]
    result = CraftReorderPostprocessor(policy="frequency").reorder(nodes)
    assert node_ids(result.nodes[:2]) == ["doc", "n1"]  # planned (tie: by key)
    assert result.nodes[2:] == [image, empty, media_doc]
    assert result.passthrough == (image, empty, media_doc)


def test_only_non_text_nodes_come_back_untouched() -> None:
    image = NodeWithScore(node=ImageNode(id_="img", image_url="https://example.com/x.png"))
    result = CraftReorderPostprocessor().reorder([image])
    assert result.nodes == [image] and result.plan is None


def test_duplicate_node_ids_with_same_text_are_reported_not_lost() -> None:
    a, dup = make_node(1, "same"), make_node(1, "same")
    result = CraftReorderPostprocessor().reorder([a, make_node(2), dup])
    assert node_ids(result.nodes) == ["n1", "n2"]
    assert result.repeated_in_request == (dup,)


def test_duplicate_node_ids_with_different_text_raise() -> None:
    with pytest.raises(ValueError, match="content_hash"):
        CraftReorderPostprocessor().reorder([make_node(1, "one"), make_node(1, "other")])
    # Keyed by content they are two chunks.
    result = CraftReorderPostprocessor(key_source="content_hash").reorder(
        [make_node(1, "one"), make_node(1, "other")]
    )
    assert len(result.nodes) == 2


def test_content_hash_keeps_equal_text_under_different_ids() -> None:
    """Issue 11 item 10: only the same node (id and text) twice is one chunk."""
    a, b = make_node("a", "shared paragraph"), make_node("b", "shared paragraph")
    result = CraftReorderPostprocessor(key_source="content_hash").reorder([a, b, a])
    assert sorted(node_ids(result.nodes)) == ["na", "nb"] and result.repeated_in_request == (a,)
    assert result.plan is not None and result.plan.keys[0].startswith("sha256:")
    assert sorted(result.plan.keys)[1] == sorted(result.plan.keys)[0] + "#2"


def test_items_that_are_not_nodes_with_score_raise() -> None:
    with pytest.raises(ValueError, match="NodeWithScore"):
        CraftReorderPostprocessor().reorder([TextNode(text="bare")])  # type: ignore[list-item]


def test_events_carry_the_plan(events: EventRecorder) -> None:
    pp = CraftReorderPostprocessor(conversation_id="c", keeps_earlier_chunks=True)
    pp.postprocess_nodes(make_nodes([1]), query_bundle=QueryBundle("q1"))
    pp.postprocess_nodes(make_nodes([1, 2]), query_bundle=QueryBundle("q2"))
    starts = events.of(CraftReorderStartEvent)
    ends = events.of(CraftReorderEndEvent)
    commits = events.of(CraftCommitEvent)
    assert [s.conversation_id for s in starts] == ["c", "c"]
    assert str(starts[1].query) == "q2"
    assert node_ids(ends[1].nodes) == ["n2"]
    assert node_ids(ends[1].removed_duplicates) == ["n1"]
    assert ends[1].plan.keys == ("n2",) and ends[1].committed
    assert [c.source for c in commits] == ["postprocess", "postprocess"]
    assert ends[0].span_id is not None  # emitted inside the postprocess span


def test_postprocess_mode_commits_without_engine_feedback() -> None:
    pp = CraftReorderPostprocessor()
    result = pp.reorder(make_nodes([1, 2]))
    assert result.committed and pp.planner.stats.commits == 1
    assert pp.claim_plan(result.nodes) is None


def test_engine_mode_parks_the_plan_for_the_engine_path() -> None:
    pp = CraftReorderPostprocessor(commit_mode="engine")
    result = pp.reorder(make_nodes([1, 2]))
    assert not result.committed and pp.planner.stats.commits == 0
    assert pp.planner.waiting() == 1
    assert pp.claim_plan(list(reversed(result.nodes))) is None  # another order: not this plan
    plan = pp.claim_plan(result.nodes)
    assert plan is not None and plan is result.plan
    assert pp.claim_plan(result.nodes) is None and pp.planner.waiting() == 0
    pp.planner.commit(plan)
    assert pp.planner.stats.commits == 1


def test_engine_mode_without_parking_hands_the_plan_to_the_caller() -> None:
    pp = CraftReorderPostprocessor(commit_mode="engine", conversation_id="c")
    result = pp.reorder(make_nodes([1, 2]), park=False)
    assert result.plan is not None and not result.committed
    assert pp.planner.waiting() == 0 and pp.planner.stats.commits == 0
    assert pp.planner.is_pending(result.plan)  # the caller serves and commits it
