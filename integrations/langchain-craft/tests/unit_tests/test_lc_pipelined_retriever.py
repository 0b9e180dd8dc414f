"""``CraftRetriever(speculative=...)``: speculative retrieval pipelining over a real
langchain-community ``FAISS`` vector store holding a faiss IVF index (embeddings given, no
model), with a ``CraftEngine`` over the fake backend (``craft_rag.testing``)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.runnables import RunnableLambda
from langchain_craft import (
    ChatCraftVLLM,
    CraftDocuments,
    CraftRAGPrompt,
    CraftReorder,
    CraftRetriever,
)

from craft_rag.engine import CraftEngine, SpeculativePrefill
from craft_rag.testing import FakeBackend
from craft_rag.testing.indexes import make_faiss_index

faiss = pytest.importorskip("faiss")
np = pytest.importorskip("numpy")
pytest.importorskip("langchain_community.vectorstores")

DIM = 16
QUERIES = 24


def vectors(n: int = 400) -> Any:
    return np.random.default_rng(3).standard_normal((n, DIM)).astype("float32")


def question(i: int) -> str:
    return f"Which item is like item {i}?"


class QueryTable(Embeddings):
    """Each test question's vector: item ``i``'s vector plus noise (documents come with
    their own vectors)."""

    def __init__(self) -> None:
        x = vectors()
        self.table: dict[str, list[float]] = {}
        for i in range(QUERIES):
            rng = np.random.default_rng(100 + i)
            self.table[question(i)] = (x[i] + 0.6 * rng.standard_normal(DIM)).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.table[text]

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        raise NotImplementedError("the documents are added with their vectors")


@functools.cache
def make_store(ivf: bool) -> Any:
    """A FAISS store over a new index (built once per process: read-only in these tests)."""
    from langchain_community.docstore.in_memory import InMemoryDocstore
    from langchain_community.vectorstores import FAISS

    x = vectors()
    index = make_faiss_index(x, ivf=ivf, nlist=16)
    store = FAISS(QueryTable(), index, InMemoryDocstore(), {})
    texts = [f"Passage {i} tells of item {i}." for i in range(len(x))]
    store.add_embeddings(
        list(zip(texts, x.tolist(), strict=True)), ids=[f"d{i}" for i in range(len(x))]
    )
    return store


def base(ivf: bool = True, **kwargs: Any) -> Any:
    return make_store(ivf).as_retriever(**{"search_kwargs": {"k": 3}, **kwargs})


def ids(docs: list[Document]) -> list[str]:
    return [str(d.id) for d in docs]


def test_pipelined_retrieval_hands_the_plan_to_the_engine(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    engine = fake[0]
    reorder = CraftReorder(planner=engine.planner, commit=False)
    plain = base()
    wrapped = CraftRetriever(
        retriever=plain, reorder=reorder, speculative=SpeculativePrefill(engine), stages=4
    )
    assert wrapped.pipelined
    reused = restarted = 0
    for i in range(QUERIES):
        got = wrapped.invoke(question(i))
        report = wrapped.last_pipeline
        assert report is not None and report.stages == 4
        assert isinstance(got, CraftDocuments) and not got.committed
        assert sorted(ids(got)) == sorted(ids(plain.invoke(question(i))))  # the exact top-k
        # The documents come back in the final plan's order; serving that pending plan hits
        # the speculation's prefill exactly when one was kept (a stable set).
        plan = got.plan
        assert plan is not None and list(plan.keys) == ids(got)
        result = engine.generate(list(plan.ordered), question(i), plan=plan.ref)
        assert (result.report.cached_tokens > 0) == report.reused
        assert report.speculations >= report.restarts + report.reused
        reused += report.reused
        restarted += report.restarts > 0
    # The queries sit between clusters often enough that both cases occur.
    assert reused > 0, "no speculation was kept: the test saw no stable set"
    assert restarted > 0, "no speculation was restarted: the test saw no changed set"
    assert engine.planner.stats.commits == QUERIES and engine.planner.waiting() == 0


def test_the_chat_model_serves_the_speculated_plan(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    engine = fake[0]
    model = ChatCraftVLLM(engine=engine, max_tokens=2)
    wrapped = CraftRetriever(
        retriever=base(), reorder=model.reorder_step(), speculative=SpeculativePrefill(engine)
    )
    seen: list[CraftDocuments] = []

    def keep(docs: list[Document]) -> list[Document]:
        assert isinstance(docs, CraftDocuments)
        seen.append(docs)
        return docs

    chain = (
        {"context": wrapped | RunnableLambda(keep), "question": RunnableLambda(lambda q: q)}
        | CraftRAGPrompt()
        | model
    )
    kept = 0
    for i in range(6):
        msg = chain.invoke(question(i))
        report = wrapped.last_pipeline
        assert report is not None
        craft = msg.response_metadata["craft"]
        assert craft["chunk_order"] == ids(seen[-1])
        assert seen[-1].plan is not None and craft["plan_id"] == seen[-1].plan.plan_id
        cache_read = msg.usage_metadata["input_token_details"]["cache_read"]  # type: ignore[index]
        if report.reused:
            assert cache_read > 0
        kept += report.reused
    assert kept > 0
    assert engine.planner.stats.commits == 6 and engine.planner.waiting() == 0


async def test_async_commit_mode_and_k(fake: tuple[CraftEngine, FakeBackend]) -> None:
    engine = fake[0]
    reorder = CraftReorder(planner=engine.planner)  # commits at once
    wrapped = CraftRetriever(
        retriever=base(), reorder=reorder, speculative=SpeculativePrefill(engine), stages=2
    )
    got = await wrapped.ainvoke(question(1))
    assert isinstance(got, CraftDocuments) and got.committed and len(got) == 3
    assert wrapped.last_pipeline is not None and wrapped.last_pipeline.stages == 2
    two = wrapped.invoke(question(2), k=2)
    assert sorted(ids(two)) == sorted(ids(base().invoke(question(2), k=2)))
    assert engine.planner.stats.commits == 2 and engine.planner.waiting() == 0


def test_other_retrievers_and_calls_search_as_usual(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    engine = fake[0]
    spec = SpeculativePrefill(engine)

    def wrap(retriever: Any, reorder: CraftReorder | None = None) -> CraftRetriever:
        reorder = reorder or CraftReorder(planner=engine.planner)
        return CraftRetriever(retriever=retriever, reorder=reorder, speculative=spec)

    flat = wrap(base(ivf=False))
    assert not flat.pipelined
    got = flat.invoke(question(0))
    # Unchanged: the same documents, in the order a fresh planner gives them.
    assert ids(got) == ids(CraftRetriever(retriever=base(ivf=False)).invoke(question(0)))
    assert flat.last_pipeline is None
    assert not wrap(base(search_type="mmr")).pipelined
    assert not wrap(base(search_kwargs={"k": 3, "filter": {"x": 1}})).pipelined
    assert not CraftRetriever(retriever=base()).pipelined  # not opted in
    # A deduplicating conversation is searched as usual, per call.
    chat = wrap(base(), CraftReorder(planner=engine.planner, keeps_earlier_chunks=True))
    assert chat.pipelined
    chat.invoke(question(3), {"configurable": {"session_id": "s1"}})
    assert chat.last_pipeline is None
    chat.invoke(question(3))  # no conversation id: pipelined
    assert chat.last_pipeline is not None


def test_settings_errors(fake: tuple[CraftEngine, FakeBackend]) -> None:
    engine = fake[0]
    spec = SpeculativePrefill(engine)
    with pytest.raises(ValueError, match="engine's planner"):
        CraftRetriever(retriever=base(), speculative=spec)
    with pytest.raises(ValueError, match="SpeculativePrefill"):
        CraftRetriever(retriever=base(), speculative=object())  # type: ignore[arg-type]
    bad: Any
    for bad in (0, True, "4"):
        with pytest.raises(ValueError, match="stages must be an int"):
            CraftRetriever(retriever=base(), stages=bad)
    wrapped = CraftRetriever(
        retriever=base(), reorder=CraftReorder(planner=engine.planner), speculative=spec
    )
    with pytest.raises(ValueError, match="k must be"):
        wrapped.invoke(question(0), k=0)
    assert engine.planner.waiting() == 0
