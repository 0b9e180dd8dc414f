"""The LlamaIndex and LangChain integration paths against the real server (``server=`` on
``CraftVLLM`` / ``ChatCraftVLLM``): chunks reach the server token-exact and in CRAFT order,
and the second request reuses the first's KV. Real llama-index-core and langchain-core."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

pytestmark = pytest.mark.server

TOPICS = ["rivers", "volcanoes", "glaciers", "deserts", "forests"]


def texts(tag: str, n: int = 3) -> list[tuple[str, str]]:
    """``n`` distinct ~90-token passages unique to ``tag`` (no other test shares them)."""
    return [
        (
            f"{tag}-{i}",
            " ".join(
                f"Fact {j} about {TOPICS[i % 5]} number {i} from collection {tag}: they shape land."
                for j in range(6)
            ),
        )
        for i in range(n)
    ]


def test_llamaindex_query_engine_over_the_server(vllm_server: str) -> None:
    pytest.importorskip("llama_index.core")
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.llms.craft_vllm import CraftVLLM, craft_query_engine

    tag = uuid.uuid4().hex[:8]
    nodes = [TextNode(id_=key, text=text) for key, text in texts(tag)]
    orders = iter([nodes, nodes[::-1]])

    class Fixed(BaseRetriever):
        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            return [NodeWithScore(node=n, score=1.0) for n in next(orders)]

    llm = CraftVLLM(server=vllm_server, max_tokens=2)
    try:
        assert llm.engine.block_size == 32
        query_engine = craft_query_engine(Fixed(), llm)
        first = query_engine.query("Which facts are about rivers?")
        second = query_engine.query("Which facts are about glaciers?")
        one, two = first.metadata["craft_reuse"], second.metadata["craft_reuse"]
        assert two.chunk_order == one.chunk_order  # CRAFT served the cached order again
        assert [n.node.node_id for n in second.source_nodes] == list(two.chunk_order)
        assert two.cached_tokens >= (two.predicted_tokens or 0) // 32 * 32 > 0
        assert one.cached_tokens == 0 or one.cached_tokens < two.cached_tokens
    finally:
        llm.close()


def test_langchain_chain_and_conversation_over_the_server(vllm_server: str) -> None:
    pytest.importorskip("langchain_core")
    from langchain_core.documents import Document
    from langchain_core.messages import BaseMessage
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough
    from langchain_craft import ChatCraftVLLM, CraftConversation, CraftRAGPrompt

    tag = uuid.uuid4().hex[:8]
    docs = [Document(page_content=t, id=k) for k, t in texts(tag, 4)]
    model = ChatCraftVLLM(server=vllm_server, max_tokens=2)
    try:
        retrieved = iter([docs[:3], docs[:3][::-1]])
        chain = (
            {
                "context": RunnableLambda(lambda _: next(retrieved)),
                "question": RunnablePassthrough(),
            }
            | CraftRAGPrompt()
            | model
        )
        first = chain.invoke("Which facts are about rivers?").response_metadata["craft"]
        second = chain.invoke("Which facts are about glaciers?").response_metadata["craft"]
        assert second["chunk_order"] == first["chunk_order"]
        assert second["cached_tokens"] >= second["prompt_tokens"] - 64

        class History:
            def __init__(self) -> None:
                self.messages: list[BaseMessage] = []

            def add_messages(self, messages: Any) -> None:
                self.messages.extend(messages)

            def clear(self) -> None:
                self.messages = []

        turns = iter([docs[:2], [docs[1], docs[3]]])
        store: dict[str, History] = {}
        conv = CraftConversation(
            llm=model,
            retriever=RunnableLambda(lambda _: next(turns)),
            get_session_history=lambda sid: store.setdefault(sid, History()),
        )
        config: Any = {"configurable": {"session_id": f"srv-{tag}"}}
        one = conv.invoke("First?", config).response_metadata["craft"]
        two = conv.invoke("Second?", config).response_metadata["craft"]
        assert two["removed_duplicates"] == [f"{tag}-1"]
        assert two["cached_tokens"] >= one["prompt_tokens"] - 32
    finally:
        model.close()


def test_llamaindex_chat_engine_over_the_server(vllm_server: str) -> None:
    """CraftChatEngine on CraftVLLM(server=...): turn 2 is append-only on turn 1 (its cached
    prefix reused by the server), the chunk both turns retrieved is sent once, and the condense
    step runs on the server with its own report."""
    pytest.importorskip("llama_index.core")
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.llms.craft_vllm import CraftChatEngine, CraftVLLM

    tag = uuid.uuid4().hex[:8]
    nodes = [TextNode(id_=key, text=text) for key, text in texts(tag, 4)]
    turns = iter([nodes[:2], [nodes[1], nodes[3]]])

    class Turns(BaseRetriever):
        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            return [NodeWithScore(node=n, score=1.0) for n in next(turns)]

    llm = CraftVLLM(server=vllm_server, max_tokens=2)
    try:
        # The server serves the embedded model, where auto skips condensing: forced here.
        chat = CraftChatEngine(Turns(), llm, conversation_id=f"srv-chat-{tag}", condense=True)
        first = chat.chat("Which facts are about rivers?")
        second = chat.chat("And which about glaciers?")
        one, two = first.metadata["craft_reuse"], second.metadata["craft_reuse"]
        assert one.turn == 1 and two.turn == 2
        assert list(two.removed_duplicates) == [f"{tag}-1"]
        assert two.cached_tokens >= one.prompt_tokens // 32 * 32 - 32 > 0
        condensed = second.metadata["craft_condense"]
        assert condensed is not None and condensed.report is not None
    finally:
        llm.close()
