"""``CraftRetriever(speculative=...)``: speculative retrieval pipelining over a real LlamaIndex
``VectorStoreIndex`` on a ``FaissVectorStore`` holding a faiss IVF index (embeddings given, no
model), with a ``CraftEngine`` over the fake backend (``craft_rag.testing``)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.postprocessor.craft import CraftReorderPostprocessor
from llama_index.retrievers.craft import CraftRetriever

from craft_rag.engine import CraftEngine, SpeculativePrefill
from craft_rag.testing import make_fake_engine
from craft_rag.testing.indexes import make_faiss_index

faiss = pytest.importorskip("faiss")
np = pytest.importorskip("numpy")
pytest.importorskip("llama_index.vector_stores.faiss")

DIM = 16


@pytest.fixture
def engine() -> Iterator[CraftEngine]:
    engine, _ = make_fake_engine()
    yield engine
    engine.close()


def vectors(n: int = 200) -> Any:
    rng = np.random.default_rng(3)
    centers = rng.standard_normal((4, DIM))
    x = centers[rng.integers(0, 4, n)] + 0.5 * rng.standard_normal((n, DIM))
    return x.astype("float32")


@functools.cache
def make_retriever(ivf: bool, top_k: int = 3) -> Any:
    """A retriever over a new index (built once per process: read-only in these tests)."""
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.schema import TextNode
    from llama_index.vector_stores.faiss import FaissVectorStore

    x = vectors()
    index = make_faiss_index(x, ivf=ivf, nlist=4)
    nodes = [
        TextNode(text=f"Passage {i} tells of item {i}.", id_=f"n{i}", embedding=row.tolist())
        for i, row in enumerate(x)
    ]
    store = FaissVectorStore(faiss_index=index)
    built = VectorStoreIndex(
        nodes,
        storage_context=StorageContext.from_defaults(vector_store=store),
        embed_model=MockEmbedding(embed_dim=DIM),
    )
    return built.as_retriever(similarity_top_k=top_k)


def query(i: int) -> QueryBundle:
    rng = np.random.default_rng(100 + i)
    vector = vectors()[i] + 0.3 * rng.standard_normal(DIM)
    return QueryBundle(query_str=f"Which item is like item {i}?", embedding=vector.tolist())


def ids(nodes: list[NodeWithScore]) -> list[str]:
    return [n.node.node_id for n in nodes]


def test_pipelined_retrieval_hands_the_plan_to_the_engine(engine: CraftEngine) -> None:
    base = make_retriever(ivf=True)
    reorderer = CraftReorderPostprocessor(planner=engine.planner, commit_mode="engine")
    wrapped = CraftRetriever(base, reorderer, speculative=SpeculativePrefill(engine), stages=2)
    assert wrapped.pipelined
    reused = 0
    for i in range(6):
        bundle = query(i)
        got = wrapped.retrieve(bundle)
        report = wrapped.last_pipeline
        assert report is not None and report.stages == 2
        assert sorted(ids(got)) == sorted(ids(base.retrieve(bundle)))  # the exact top-k
        # The plan waits for the engine path, in the nodes' order; serving it hits the
        # speculation's prefill when one was kept.
        plan = reorderer.claim_plan(got)
        assert plan is not None and list(plan.keys) == ids(got)
        result = engine.generate(list(plan.ordered), bundle.query_str, plan=plan.ref)
        assert (result.report.cached_tokens > 0) == report.reused
        reused += report.reused
    assert reused > 0, "no speculation was kept: the test saw no prefill reuse"
    assert engine.planner.stats.commits == 6 and engine.planner.waiting() == 0


async def test_async_and_postprocess_mode(engine: CraftEngine) -> None:
    reorderer = CraftReorderPostprocessor(planner=engine.planner)  # commits at once
    wrapped = CraftRetriever(
        make_retriever(ivf=True), reorderer, speculative=SpeculativePrefill(engine)
    )
    got = await wrapped.aretrieve(query(1))
    assert len(got) == 3 and engine.planner.stats.commits == 1
    assert engine.planner.waiting() == 0


def test_other_indexes_and_conversations_search_as_usual(engine: CraftEngine) -> None:
    reorderer = CraftReorderPostprocessor(planner=engine.planner, commit_mode="engine")
    spec = SpeculativePrefill(engine)
    flat = CraftRetriever(make_retriever(ivf=False), reorderer, speculative=spec)
    assert not flat.pipelined
    assert len(flat.retrieve(query(0))) == 3 and flat.last_pipeline is None
    chat = CraftReorderPostprocessor(
        planner=engine.planner, commit_mode="engine", conversation_id="c1"
    )
    assert not CraftRetriever(make_retriever(ivf=True), chat, speculative=spec).pipelined
    assert not CraftRetriever(make_retriever(ivf=True)).pipelined  # not opted in


def test_settings_errors(engine: CraftEngine) -> None:
    base = make_retriever(ivf=True)
    spec = SpeculativePrefill(engine)
    with pytest.raises(ValueError, match="engine's planner"):
        CraftRetriever(base, speculative=spec)
    with pytest.raises(ValueError, match="SpeculativePrefill"):
        CraftRetriever(base, speculative=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stages"):
        CraftRetriever(base, stages=0)
