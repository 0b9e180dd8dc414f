"""CraftRetriever over an in-memory vector store (no engine)."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_craft import CraftDocuments, CraftReorder, CraftRetriever

from craft_rag import CraftPlanner


def make_base(n: int = 6) -> BaseRetriever:
    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    store.add_documents(
        [Document(page_content=f"passage {i}", id=f"p{i}", metadata={"i": i}) for i in range(n)]
    )
    return store.as_retriever(search_kwargs={"k": n})


def test_applies_the_plan_to_the_base_results() -> None:
    base = make_base()
    planner = CraftPlanner()
    retriever = CraftRetriever(retriever=base, reorder=CraftReorder(planner=planner), k=3)
    top3 = [d.id for d in base.invoke("passage 2")][:3]
    out = retriever.invoke("passage 2")
    assert isinstance(out, CraftDocuments)
    assert sorted(d.id or "" for d in out) == sorted(d or "" for d in top3)
    assert planner.stats.commits == 1


def test_k_kwarg_overrides_and_is_validated() -> None:
    retriever = CraftRetriever(retriever=make_base(), k=4)
    assert len(retriever.invoke("passage 1", k=2)) == 2
    assert len(retriever.invoke("passage 1")) == 4
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        retriever.invoke("passage 1", k=0)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        CraftRetriever(retriever=make_base(), k=-1)


def test_conversation_from_config_dedups_across_turns() -> None:
    reorder = CraftReorder(keeps_earlier_chunks=True)
    retriever = CraftRetriever(retriever=make_base(), k=3, reorder=reorder)
    config = {"configurable": {"conversation_id": "c1"}}
    first = retriever.invoke("passage 1", config)  # type: ignore[arg-type]
    second = retriever.invoke("passage 1", config, k=5)  # type: ignore[arg-type]
    assert isinstance(second, CraftDocuments)
    assert {d.id for d in second.removed_duplicates} == {d.id for d in first}
    assert len(second) == 2


async def test_async_matches_sync() -> None:
    sync_r = CraftRetriever(retriever=make_base(), k=3)
    async_r = CraftRetriever(retriever=make_base(), k=3)
    for q in ("passage 1", "passage 4", "passage 1"):
        assert [d.id for d in await async_r.ainvoke(q)] == [d.id for d in sync_r.invoke(q)]


def test_empty_base_result_passes_through() -> None:
    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=8))
    planner = CraftPlanner()
    retriever = CraftRetriever(
        retriever=store.as_retriever(), reorder=CraftReorder(planner=planner)
    )
    assert retriever.invoke("anything") == []
    assert planner.stats.plans == 0
