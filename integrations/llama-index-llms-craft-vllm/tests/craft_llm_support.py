"""Test helpers for llama-index-llms-craft-vllm: node factories, an event recorder, a small real
faiss vector index over SQuAD passages with the packaged MiniLM model. A uniquely named module
(not ``conftest``), so a root run that also collects the sibling packages' tests imports the
right one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index_instrumentation.base import BaseEvent

CORPUS_SIZE = 96
"""SQuAD paragraphs in the test index: the first articles of the dev set (~15 s to embed the
first time on 2 cores, then read from craft-rag's embedding cache)."""


def make_node(i: int | str, text: str | None = None, score: float = 1.0) -> NodeWithScore:
    name = str(i)
    return NodeWithScore(node=TextNode(id_=f"n{name}", text=text or f"text {name}"), score=score)


def assert_whole_prefix_reused(engine: Any, chunks: Sequence[Any], report: Any) -> None:
    """``report`` (a repeated single-turn request) reused every cacheable prompt token (whole
    blocks, the last prompt token excluded), and its ``reused_chunks`` is the count of served
    chunks lying entirely inside the cached prefix (issue 11 item 9,
    :func:`craft_rag.metrics.chunks_inside_cache`) over the spans the engine's assembler gives
    ``chunks`` (any order: they are put in ``report.chunk_order``). A last chunk whose tail
    shares the trailing partial block with the question does not count."""
    from craft_rag.metrics import chunks_inside_cache

    by_key = {c.key: c for c in chunks}
    served = [by_key[k] for k in report.chunk_order]
    spans = engine.assembler.single_turn(served, "?").chunk_spans
    block = engine.block_size
    assert report.cached_tokens == (report.prompt_tokens - 1) // block * block > 0
    assert report.reused_chunks == chunks_inside_cache(spans, report.cached_tokens)
    assert report.reused_chunks >= len(served) - 1  # only a last chunk may miss the rule


def make_nodes(ids: Sequence[int | str]) -> list[NodeWithScore]:
    return [make_node(i) for i in ids]


def node_ids(nodes: Sequence[NodeWithScore]) -> list[str]:
    return [n.node.node_id for n in nodes]


class EventRecorder(BaseEventHandler):
    """Collects every instrumentation event while installed on the root dispatcher."""

    events: list[BaseEvent]

    @classmethod
    def class_name(cls) -> str:
        return "EventRecorder"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        self.events.append(event)

    def of(self, cls: type[BaseEvent]) -> list[Any]:
        return [e for e in self.events if isinstance(e, cls)]


@dataclass(frozen=True)
class SquadIndex:
    """A real ``VectorStoreIndex`` over a ``FaissVectorStore`` plus the questions it can answer."""

    index: Any
    embed_model: Any
    questions: tuple[str, ...]
    passage_ids: tuple[str, ...]


def build_squad_index() -> SquadIndex:
    """The index behind the session fixture ``squad_index``; skips when faiss, the LlamaIndex
    faiss store or the packaged model is missing."""
    faiss = pytest.importorskip("faiss", reason="pip install faiss-cpu")
    pytest.importorskip(
        "llama_index.vector_stores.faiss", reason="pip install llama-index-vector-stores-faiss"
    )
    pytest.importorskip(
        "llama_index.embeddings.huggingface",
        reason="pip install llama-index-embeddings-huggingface",
    )
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.vector_stores.faiss import FaissVectorStore

    from craft_rag_bench.datasets import load_squad
    from craft_rag_bench.retrieval import Embedder, embed_passages

    try:
        embedder = Embedder()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    squad = load_squad()
    passages = squad.passages[:CORPUS_SIZE]
    # Passage vectors come from craft-rag's on-disk embedding cache (same MiniLM weights), so
    # only the first run pays the encoder; query vectors come from LlamaIndex's embed model.
    vectors = embed_passages(passages, embedder, show_progress=False)
    nodes = [
        TextNode(id_=p.id, text=p.content, embedding=vectors[i].tolist())
        for i, p in enumerate(passages)
    ]
    store = FaissVectorStore(faiss_index=faiss.IndexFlatIP(vectors.shape[1]))
    embed_model = HuggingFaceEmbedding(model_name=str(embedder.model_dir), device="cpu")
    index = VectorStoreIndex(
        nodes,
        storage_context=StorageContext.from_defaults(vector_store=store),
        embed_model=embed_model,
    )
    ids = {p.id for p in passages}
    questions = tuple(
        q.question for q in squad.questions if q.passage_ids and q.passage_ids[0] in ids
    )
    return SquadIndex(index, embed_model, questions[:200], tuple(p.id for p in passages))
