"""Test helpers for code built on the CRAFT LlamaIndex packages (like :mod:`craft_rag.testing`).

Node factories (:func:`make_node`, :func:`make_nodes`, :func:`node_ids`), an instrumentation
:class:`EventRecorder` with :func:`recording_events` (installs it on the root dispatcher for a
``with`` block), and :func:`build_squad_index`: a real faiss ``VectorStoreIndex`` over SQuAD
passages with the packaged MiniLM model. The index needs the optional test dependencies
(pytest, faiss-cpu, llama-index-vector-stores-faiss, llama-index-embeddings-huggingface and the
``craft_rag_bench`` harness); they are imported only when it is built, and a missing one skips
the calling test. It is built once per process (cached), so a repository-wide run that collects
several packages' tests embeds the passages once.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index_instrumentation import get_dispatcher

__all__ = [
    "CORPUS_SIZE",
    "EventRecorder",
    "SquadIndex",
    "build_squad_index",
    "make_node",
    "make_nodes",
    "node_ids",
    "recording_events",
]

CORPUS_SIZE = 96
"""SQuAD paragraphs in the test index: the first articles of the dev set (~15 s to embed the
first time on 2 cores, then read from craft-rag's embedding cache)."""


def make_node(i: int | str, text: str | None = None, score: float = 1.0) -> NodeWithScore:
    """A scored text node with id ``n<i>`` and text ``text`` (default ``text <i>``)."""
    name = str(i)
    return NodeWithScore(node=TextNode(id_=f"n{name}", text=text or f"text {name}"), score=score)


def make_nodes(ids: Sequence[int | str]) -> list[NodeWithScore]:
    """One :func:`make_node` per id, in order."""
    return [make_node(i) for i in ids]


def node_ids(nodes: Sequence[NodeWithScore]) -> list[str]:
    """The node ids of ``nodes``, in order."""
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
        """The recorded events that are instances of ``cls``, in arrival order."""
        return [e for e in self.events if isinstance(e, cls)]


@contextmanager
def recording_events() -> Iterator[EventRecorder]:
    """An :class:`EventRecorder` installed on the root dispatcher for the ``with`` block; it is
    removed afterwards even when the block raises (other handlers are left as they were)."""
    recorder = EventRecorder(events=[])
    root = get_dispatcher()
    root.add_event_handler(recorder)
    try:
        yield recorder
    finally:
        root.event_handlers = [h for h in root.event_handlers if h is not recorder]


@dataclass(frozen=True)
class SquadIndex:
    """A real ``VectorStoreIndex`` over a ``FaissVectorStore`` plus the questions it can answer."""

    index: Any
    embed_model: Any
    questions: tuple[str, ...]
    passage_ids: tuple[str, ...]


@functools.cache
def build_squad_index() -> SquadIndex:
    """The index behind the ``squad_index`` test fixtures (built once per process); skips the
    calling test when faiss, the LlamaIndex faiss store or the packaged model is missing."""
    import pytest

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
