"""CraftReorder as a Runnable, a document transformer and a compressor (no engine)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import UUID

import pytest
from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler
from langchain_core.documents import BaseDocumentCompressor, BaseDocumentTransformer, Document
from langchain_core.runnables import Runnable, RunnableLambda
from langchain_craft import CRAFT_PLAN_EVENT, CraftDocuments, CraftReorder

from craft_rag import CraftPlanner, PlannerConfig


def make_docs(*ids: str) -> list[Document]:
    return [
        Document(page_content=f"passage {i}", id=i, metadata={"source": f"src-{i}", "n": n})
        for n, i in enumerate(ids)
    ]


class EventRecorder(BaseCallbackHandler):
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def on_custom_event(self, name: str, data: Any, **kwargs: Any) -> None:
        self.events.append((name, data))


class AsyncEventRecorder(AsyncCallbackHandler):
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    async def on_custom_event(self, name: str, data: Any, **kwargs: Any) -> None:
        self.events.append((name, data))


def ids(docs: Sequence[Document]) -> list[str]:
    return [d.id or "" for d in docs]


def test_is_runnable_transformer_and_compressor() -> None:
    reorder = CraftReorder()
    assert isinstance(reorder, Runnable)
    assert isinstance(reorder, BaseDocumentTransformer)
    assert isinstance(reorder, BaseDocumentCompressor)


def test_lcel_keeps_document_objects_metadata_and_ids() -> None:
    docs = make_docs("a", "b", "c")

    def retrieve(_: str) -> list[Document]:
        return docs

    out = (RunnableLambda(retrieve) | CraftReorder()).invoke("q")
    assert isinstance(out, CraftDocuments)
    assert sorted(map(id, out)) == sorted(map(id, docs))  # the very same objects
    assert {d.id: d.metadata for d in out} == {d.id: d.metadata for d in docs}


def test_shared_chunks_move_into_the_served_prefix() -> None:
    reorder = CraftReorder()
    first = reorder.invoke(make_docs("a", "b", "c"))
    assert ids(first) == ["a", "b", "c"]
    # The tree policy puts the served path {a, b} first, then the rest.
    second = reorder.invoke(make_docs("d", "b", "a"))
    assert ids(second) == ["a", "b", "d"]
    assert isinstance(second, CraftDocuments)
    assert second.plan is not None and second.plan.matched_chunks == 2


def test_retriever_policy_keeps_retriever_order() -> None:
    reorder = CraftReorder(planner=CraftPlanner(PlannerConfig(policy="retriever")))
    reorder.invoke(make_docs("a", "b", "c"))
    assert ids(reorder.invoke(make_docs("d", "b", "a"))) == ["d", "b", "a"]


def test_shared_planner_across_steps() -> None:
    planner = CraftPlanner()
    CraftReorder(planner=planner).invoke(make_docs("x", "y"))
    assert ids(CraftReorder(planner=planner).invoke(make_docs("z", "y", "x"))) == ["x", "y", "z"]
    assert planner.stats.commits == 2


def test_conversation_dedup_from_config_reports_removed() -> None:
    reorder = CraftReorder(keeps_earlier_chunks=True)
    config: Any = {"configurable": {"session_id": "s1"}}
    reorder.invoke(make_docs("a", "b"), config)
    out = reorder.invoke(make_docs("b", "c", "a"), config)
    assert ids(out) == ["c"]
    assert isinstance(out, CraftDocuments)
    assert ids(out.removed_duplicates) == ["b", "a"]
    assert out.plan is not None and out.plan.turn == 2
    # Another session sees everything.
    other = reorder.invoke(make_docs("b", "c", "a"), {"configurable": {"session_id": "s2"}})
    assert isinstance(other, CraftDocuments)
    assert len(other) == 3 and other.removed_duplicates == ()


@pytest.mark.parametrize(
    ("configurable", "expected"),
    [
        ({"conversation_id": "c", "session_id": "s", "thread_id": "t"}, "c"),
        ({"session_id": "s", "thread_id": "t"}, "s"),
        ({"thread_id": UUID(int=7)}, str(UUID(int=7))),
        ({"thread_id": 42}, "42"),
        ({"user_id": "u"}, None),
    ],
)
def test_conversation_id_keys(configurable: dict[str, Any], expected: str | None) -> None:
    step = CraftReorder(keeps_earlier_chunks=True)
    out = step.invoke(make_docs("a"), {"configurable": configurable})
    assert isinstance(out, CraftDocuments) and out.plan is not None
    assert out.plan.conversation_id == expected


def test_conversation_keys_can_be_disabled_and_fixed_id_used() -> None:
    out = CraftReorder(
        conversation_keys=(), conversation_id="fixed", keeps_earlier_chunks=True
    ).invoke(
        make_docs("a"), {"configurable": {"session_id": "s"}}
    )
    assert isinstance(out, CraftDocuments) and out.plan is not None
    assert out.plan.conversation_id == "fixed"


@pytest.mark.parametrize("bad", ["", 3.5, True, ["s"]])
def test_bad_conversation_id_is_a_clear_error(bad: Any) -> None:
    with pytest.raises(ValueError, match="session_id"):
        CraftReorder().invoke(make_docs("a"), {"configurable": {"session_id": bad}})


def test_custom_event_carries_the_plan() -> None:
    recorder = EventRecorder()
    CraftReorder().invoke(make_docs("a", "b"), {"callbacks": [recorder]})
    [(name, data)] = recorder.events
    assert name == CRAFT_PLAN_EVENT
    assert data["order"] == ["a", "b"] and data["committed"] is True
    assert data["removed_duplicates"] == [] and data["turn"] == 1


async def test_async_matches_sync_and_fires_event() -> None:
    recorder = AsyncEventRecorder()
    sync_step, async_step = CraftReorder(), CraftReorder()
    for docs in (make_docs("a", "b", "c"), make_docs("d", "b", "a"), make_docs("c", "e")):
        expected = ids(sync_step.invoke(docs))
        assert ids(await async_step.ainvoke(docs, {"callbacks": [recorder]})) == expected
    assert [name for name, _ in recorder.events] == [CRAFT_PLAN_EVENT] * 3


def test_batch() -> None:
    out = CraftReorder().batch([make_docs("a", "b"), make_docs("c")])
    assert [ids(o) for o in out] == [["a", "b"], ["c"]]


# ---- commit modes -------------------------------------------------------------------------


def test_commit_false_leaves_the_plan_pending() -> None:
    planner = CraftPlanner()
    out = CraftReorder(planner=planner, commit=False).invoke(make_docs("a", "b"))
    assert isinstance(out, CraftDocuments) and out.plan is not None
    assert out.committed is False
    assert planner.stats.commits == 0
    planner.commit(out.plan, reused_chunks=0)  # the engine path commits it
    assert planner.stats.commits == 1
    with pytest.raises(RuntimeError, match="already committed"):
        planner.commit(out.plan)


# ---- transformer and compressor -----------------------------------------------------------


def test_transformer_drop_in_for_long_context_reorder() -> None:
    docs = make_docs("a", "b", "c", "d")
    out = CraftReorder(keeps_earlier_chunks=True).transform_documents(docs, conversation_id="conv")
    assert sorted(ids(out)) == sorted(ids(docs))
    assert isinstance(out, CraftDocuments) and out.plan is not None
    assert out.plan.conversation_id == "conv"
    again = CraftReorder().transform_documents(docs)
    assert isinstance(again, CraftDocuments) and again.plan is not None
    assert again.plan.conversation_id is None


async def test_atransform_documents() -> None:
    out = await CraftReorder().atransform_documents(make_docs("b", "a"))
    # first sight: the tree policy breaks frequency ties by retriever rank (issue 16)
    assert ids(out) == ["b", "a"]
    assert isinstance(out, CraftDocuments) and out.plan is not None


def test_compressor_reads_conversation_from_enclosing_chain() -> None:
    reorder = CraftReorder(keeps_earlier_chunks=True)

    def step(docs: list[Document]) -> Sequence[Document]:
        return reorder.compress_documents(docs, "query")

    chain = RunnableLambda(step)
    chain.invoke(make_docs("a"), {"configurable": {"session_id": "s"}})
    out = chain.invoke(make_docs("a", "b"), {"configurable": {"session_id": "s"}})
    assert ids(out) == ["b"]


def test_in_contextual_compression_retriever() -> None:
    classic = pytest.importorskip("langchain_classic.retrievers")
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.vectorstores import InMemoryVectorStore

    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=8))
    store.add_documents(make_docs("a", "b", "c"))
    recorder = EventRecorder()
    retriever = classic.ContextualCompressionRetriever(
        base_compressor=CraftReorder(), base_retriever=store.as_retriever(search_kwargs={"k": 3})
    )
    out = retriever.invoke("passage a", {"callbacks": [recorder]})
    assert sorted(ids(out)) == ["a", "b", "c"]
    assert [name for name, _ in recorder.events] == [CRAFT_PLAN_EVENT]


async def test_in_contextual_compression_retriever_async() -> None:
    classic = pytest.importorskip("langchain_classic.retrievers")
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.vectorstores import InMemoryVectorStore

    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=8))
    store.add_documents(make_docs("a", "b", "c"))
    recorder = AsyncEventRecorder()
    retriever = classic.ContextualCompressionRetriever(
        base_compressor=CraftReorder(), base_retriever=store.as_retriever(search_kwargs={"k": 2})
    )
    out = await retriever.ainvoke("passage a", {"callbacks": [recorder]})
    assert len(out) == 2
    assert [name for name, _ in recorder.events] == [CRAFT_PLAN_EVENT]


# ---- bad input ----------------------------------------------------------------------------


def test_empty_list_passes_through_without_touching_the_planner() -> None:
    planner = CraftPlanner()
    recorder = EventRecorder()
    out = CraftReorder(planner=planner).invoke([], {"callbacks": [recorder]})
    assert out == [] and isinstance(out, CraftDocuments) and out.plan is None
    assert planner.stats.plans == 0 and recorder.events == []


def test_non_documents_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"documents\[1\] is a dict.*Document\(page_content"):
        CraftReorder().invoke([Document(page_content="x"), {"page_content": "y"}])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="single str"):
        CraftReorder().invoke("not a list")  # type: ignore[arg-type]


def test_document_without_page_content_is_a_clear_error() -> None:
    broken = Document.model_construct(page_content=None, metadata={})
    with pytest.raises(ValueError, match=r"documents\[0\] has no string page_content"):
        CraftReorder().invoke([broken])


def test_empty_page_content_is_an_ordinary_chunk() -> None:
    docs = [Document(page_content="", id="empty"), Document(page_content="x", id="x")]
    assert sorted(ids(CraftReorder().invoke(docs))) == ["empty", "x"]


def test_duplicate_id_same_text_is_removed_and_reported() -> None:
    a1 = Document(page_content="same", id="a", metadata={"copy": 1})
    a2 = Document(page_content="same", id="a", metadata={"copy": 2})
    out = CraftReorder().invoke([a1, Document(page_content="b", id="b"), a2])
    assert isinstance(out, CraftDocuments)
    assert [d.metadata.get("copy") for d in out if d.id == "a"] == [1]
    assert out.repeated_in_request == (a2,)
    assert out.plan is not None and [c.key for c in out.plan.repeated_in_request] == ["a"]


def test_duplicate_id_different_text_is_a_clear_error() -> None:
    docs = [Document(page_content="one", id="a"), Document(page_content="two", id="a")]
    with pytest.raises(ValueError, match="like an earlier document"):
        CraftReorder().invoke(docs)


def test_documents_without_ids_are_keyed_by_metadata_then_content() -> None:
    by_meta = [Document(page_content="t1", metadata={"id": "m1"})]
    out = CraftReorder().invoke(by_meta)
    assert isinstance(out, CraftDocuments) and out.plan is not None
    assert out.plan.keys == ("m1",)
    by_text = [Document(page_content="t1"), Document(page_content="t1")]
    out = CraftReorder().invoke(by_text)
    assert isinstance(out, CraftDocuments) and len(out) == 1
    assert len(out.repeated_in_request) == 1
    assert out.plan is not None and out.plan.keys[0].startswith("sha256:")
