"""Several LlamaIndex workers on one shared store: nodes built from the same documents carry
other random ids in each process (``SentenceSplitter``, ``VectorStoreIndex.from_documents``),
so chunk keys default to content hashes whenever the planner shares a store, and a second
worker dedups the passages the first one sent. Two real ``CraftEngine`` instances (planners,
tokenizer, prompt assembly) on one SQLite file or one real redis-server, over a fake forward
pass (two vLLM engines cannot share one process)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from llama_index.core import Document
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.memory import ChatMemoryBuffer
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.core.storage.chat_store import SimpleChatStore
from llama_index.llms.craft_vllm import CraftChatEngine, CraftVLLM, craft_query_engine
from llama_index.postprocessor.craft import CraftReorderPostprocessor

from craft_rag import CraftPlanner
from craft_rag.engine.engine import CraftEngine
from craft_rag.stores import StateStore, open_store
from craft_rag.testing import FakeBackend, make_fake_engine

TEXTS = [
    "Hamlet is a tragedy written by William Shakespeare around 1600. " * 3,
    "The play is set in Denmark and follows Prince Hamlet. " * 3,
]


def fresh_nodes() -> list[NodeWithScore]:
    """What each worker process builds from the same documents: equal texts, new random ids."""
    nodes = SentenceSplitter(chunk_size=512).get_nodes_from_documents(
        [Document(text=t) for t in TEXTS]
    )
    return [NodeWithScore(node=n, score=1.0) for n in nodes]


class Fixed(BaseRetriever):
    def __init__(self, nodes: list[NodeWithScore]) -> None:
        super().__init__()
        self.nodes = nodes

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return list(self.nodes)


def _engine(store: StateStore) -> CraftEngine:
    return make_fake_engine(FakeBackend(max_model_len=1024), store=store)[0]


@pytest.fixture(scope="module")
def redis_server() -> Iterator[str]:
    """A real redis-server database: ``CRAFT_RAG_TEST_REDIS``, else one started here."""
    url = os.environ.get("CRAFT_RAG_TEST_REDIS")
    if url:
        yield url
        return
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (apt-get install -y redis-server)")
    from craft_rag.stores.local_redis import local_redis

    with local_redis() as started:
        yield started


@pytest.fixture(params=["sqlite", "redis"])
def workers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[CraftVLLM, ...]]:
    """Two workers: each its own engine and its own connection to the same store."""
    if request.param == "sqlite":
        url = f"sqlite://{tmp_path / 'state.db'}"
    else:
        import redis

        url = str(request.getfixturevalue("redis_server"))
        client = redis.Redis.from_url(url)
        client.flushdb()  # the test's own database: start empty
        client.close()
    stores = [open_store(url), open_store(url)]
    engines = [_engine(s) for s in stores]
    yield tuple(CraftVLLM(e, max_tokens=2) for e in engines)
    for e in engines:
        e.close()
    for s in stores:
        s.close()


def _turn2_prompt_tokens(a: CraftVLLM, b: CraftVLLM, conv: str, **kwargs: object) -> int:
    first = CraftChatEngine(Fixed(fresh_nodes()), a, conversation_id=conv, **kwargs)
    first.chat("Who wrote Hamlet?")
    second = CraftChatEngine(Fixed(fresh_nodes()), b, conversation_id=conv, **kwargs)
    second.chat("Where is it set?")
    assert second.last_reuse_report is not None and second.last_reuse_report.turn == 2
    return second.last_reuse_report.prompt_tokens


def test_second_worker_dedups_what_the_first_sent_by_default(
    workers: tuple[CraftVLLM, CraftVLLM],
) -> None:
    a, b = workers
    by_default = _turn2_prompt_tokens(a, b, "shared-default", condense=False)
    by_node_id = _turn2_prompt_tokens(a, b, "shared-node-id", condense=False, key_source="node_id")
    # Keyed by random node ids both passages are "new" on worker B and sent again.
    passage_tokens = sum(len(a.engine.assembler.tokenizer.encode(t)) for t in TEXTS)
    assert by_node_id - by_default >= passage_tokens


def test_second_worker_reports_the_passages_as_already_sent(
    workers: tuple[CraftVLLM, CraftVLLM],
) -> None:
    a, b = workers
    CraftChatEngine(Fixed(fresh_nodes()), a, conversation_id="c", condense=False).chat("q1")
    second = CraftChatEngine(Fixed(fresh_nodes()), b, conversation_id="c", condense=False)
    second.chat("q2")
    assert second.last_reorder is not None
    assert len(second.last_reorder.removed_duplicates) == len(TEXTS)
    assert second.last_reorder.nodes == []


def test_key_source_defaults_follow_the_planner(tmp_path: Path) -> None:
    local = CraftReorderPostprocessor()
    assert local.key_source == "node_id"
    assert CraftReorderPostprocessor(planner=CraftPlanner()).key_source == "node_id"
    shared = CraftPlanner(store=f"sqlite://{tmp_path / 'p.db'}")
    assert CraftReorderPostprocessor(planner=shared).key_source == "content_hash"
    assert CraftReorderPostprocessor(planner=shared, key_source=None).key_source == "content_hash"
    # An explicit choice stands (nodes with ids stable across workers, e.g. a persisted docstore).
    assert CraftReorderPostprocessor(planner=shared, key_source="node_id").key_source == "node_id"
    with pytest.raises(ValueError, match="key_source"):
        CraftReorderPostprocessor(planner=shared, key_source="title")  # type: ignore[arg-type]


def test_query_engine_reorderer_and_synthesizer_agree_on_the_shared_default(
    workers: tuple[CraftVLLM, CraftVLLM],
) -> None:
    a, _ = workers
    assert a.reorderer().key_source == "content_hash"
    # The parked plan is found by chunk keys: both halves must key the same way, or the
    # engine serves an unplanned request (plan_id None).
    response = craft_query_engine(Fixed(fresh_nodes()), a).query("Who wrote Hamlet?")
    report = response.metadata["craft_reuse"] if response.metadata else None
    assert report is not None and report.plan_id is not None
    assert len(report.chunk_order) == len(TEXTS)


def test_chat_memory_shared_through_a_chat_store_keyed_by_conversation(
    workers: tuple[CraftVLLM, CraftVLLM],
) -> None:
    """The documented way to share LlamaIndex chat memory across workers: one chat store keyed
    by the conversation id (``RedisChatStore`` in a deployment; one ``SimpleChatStore`` object
    stands in for it here). The prompt itself is the engine's, shared through the planner
    store."""
    a, b = workers
    conv = "memory-shared"
    chat_store = SimpleChatStore()

    def memory() -> ChatMemoryBuffer:
        return ChatMemoryBuffer.from_defaults(chat_store=chat_store, chat_store_key=conv)

    CraftChatEngine(Fixed(fresh_nodes()), a, conversation_id=conv, memory=memory()).chat("q1")
    chat_b = CraftChatEngine(Fixed(fresh_nodes()), b, conversation_id=conv, memory=memory())
    chat_b.chat("q2")
    assert [m.content for m in chat_b.chat_history][::2] == ["q1", "q2"]
    assert chat_b.last_reuse_report is not None and chat_b.last_reuse_report.turn == 2
