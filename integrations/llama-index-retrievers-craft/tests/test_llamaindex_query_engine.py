"""The postprocessor and the retriever wrapper inside real LlamaIndex pipelines: a
``RetrieverQueryEngine`` over a ``FaissVectorStore`` with the packaged MiniLM embedding."""

from __future__ import annotations

import pytest
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.postprocessor.craft import (
    CraftReorderEndEvent,
    CraftReorderPostprocessor,
    CraftRetriever,
)
from llama_index.postprocessor.craft.testing import EventRecorder, SquadIndex, node_ids

from craft_rag import CraftPlanner

pytestmark = pytest.mark.retrieval

TOP_K = 4


def _overlapping_pair(retriever: BaseRetriever, questions: tuple[str, ...]) -> tuple[str, str]:
    """Two questions whose top-k share at least one passage, the shared ones not leading q2."""
    first = questions[0]
    base = node_ids(retriever.retrieve(first))
    for q in questions[1:60]:
        ids = node_ids(retriever.retrieve(q))
        shared = [i for i in ids if i in base]
        if shared and ids[: len(shared)] != shared:
            return first, q
    pytest.skip("no overlapping question pair in the test corpus")


def test_postprocessor_orders_sources_in_a_real_query_engine(
    squad_index: SquadIndex, events: EventRecorder
) -> None:
    retriever = squad_index.index.as_retriever(similarity_top_k=TOP_K)
    q1, q2 = _overlapping_pair(retriever, squad_index.questions)
    pp = CraftReorderPostprocessor()
    engine = RetrieverQueryEngine.from_args(
        retriever, llm=MockLLM(max_tokens=4), node_postprocessors=[pp]
    )
    first = engine.query(q1)
    second = engine.query(q2)
    plans = [e.plan for e in events.of(CraftReorderEndEvent)]
    assert len(plans) == 2
    # What the query engine answered from is exactly the planned order.
    assert tuple(node_ids(first.source_nodes)) == plans[0].keys
    assert tuple(node_ids(second.source_nodes)) == plans[1].keys
    # CRAFT moved the chunks q2 shares with q1 to the front of q2's context.
    shared = set(plans[0].keys) & set(plans[1].keys)
    assert set(plans[1].keys[: len(shared)]) == shared
    assert len(second.source_nodes) == TOP_K  # nothing lost


async def test_async_query_engine_matches_sync(squad_index: SquadIndex) -> None:
    retriever = squad_index.index.as_retriever(similarity_top_k=TOP_K)
    questions = squad_index.questions[:3]
    sync_pp = CraftReorderPostprocessor(planner=CraftPlanner(clock=lambda: 0.0))
    async_pp = CraftReorderPostprocessor(planner=CraftPlanner(clock=lambda: 0.0))
    sync_qe = RetrieverQueryEngine.from_args(
        retriever, llm=MockLLM(max_tokens=2), node_postprocessors=[sync_pp]
    )
    async_qe = RetrieverQueryEngine.from_args(
        retriever, llm=MockLLM(max_tokens=2), node_postprocessors=[async_pp]
    )
    for q in (*questions, questions[0]):
        s = sync_qe.query(q)
        a = await async_qe.aquery(q)
        assert node_ids(s.source_nodes) == node_ids(a.source_nodes)
    assert sync_pp.planner.to_json() == async_pp.planner.to_json()


async def test_retriever_wrapper_applies_the_same_plan(squad_index: SquadIndex) -> None:
    base = squad_index.index.as_retriever(similarity_top_k=TOP_K)
    planner_a = CraftPlanner(clock=lambda: 0.0)
    planner_b = CraftPlanner(clock=lambda: 0.0)
    wrapped = CraftRetriever(base, CraftReorderPostprocessor(planner=planner_a))
    pp = CraftReorderPostprocessor(planner=planner_b)
    for q in squad_index.questions[:4]:
        got = await wrapped.aretrieve(q) if q.endswith("?") else wrapped.retrieve(q)
        expected = pp.postprocess_nodes(base.retrieve(q), QueryBundle(q))
        assert node_ids(got) == node_ids(expected)
    assert planner_a.to_json() == planner_b.to_json()


class _ListRetriever(BaseRetriever):
    def __init__(self, nodes: list[NodeWithScore]) -> None:
        self._nodes = nodes
        super().__init__()

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return list(self._nodes)


def test_retriever_wrapper_settings_and_errors() -> None:
    from llama_index.postprocessor.craft.testing import make_nodes

    wrapped = CraftRetriever(_ListRetriever(make_nodes([3, 1])), policy="frequency")
    assert wrapped.reorderer.policy == "frequency"
    assert node_ids(wrapped.retrieve("q")) == ["n1", "n3"]
    with pytest.raises(ValueError, match="BaseRetriever"):
        CraftRetriever(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        CraftRetriever(_ListRetriever([]), CraftReorderPostprocessor(), policy="tree")
    assert CraftRetriever(_ListRetriever([])).retrieve("q") == []


def test_public_api_is_pinned() -> None:
    """``llama_index.retrievers.craft`` exports the retriever; the postprocessor's former
    ``CraftRetriever`` name resolves to the same class (it moved to this distribution)."""
    import llama_index.postprocessor.craft as postprocessor
    import llama_index.retrievers.craft as retrievers

    assert set(retrievers.__all__) == {"CraftRetriever"}
    assert retrievers.CraftRetriever is CraftRetriever
    assert postprocessor.CraftRetriever is CraftRetriever
