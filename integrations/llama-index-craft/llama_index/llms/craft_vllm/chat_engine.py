"""CraftChatEngine: multi-turn RAG whose prompt only ever grows at the end.

LlamaIndex's ``ContextChatEngine`` / ``CondensePlusContextChatEngine`` put each turn's retrieved
context into the system message at the front, so every turn changes the first tokens and
invalidates the KV of the whole history. Here each turn is appended:
``[head][turn-1 chunks][Q1][A1][turn-2 new chunks][Q2]...``. A chunk already sent in an earlier
turn is not sent again (CRAFT's conversation dedup); the new ones enter with the turn that
retrieved them, in CRAFT order. The engine keeps the token history per conversation id and
vLLM reuses all of it.

The LlamaIndex memory (``ChatMemoryBuffer`` by default, or any ``BaseMemory`` such as
``Memory``) stores the user and assistant messages as usual, for the application to show and
persist; the prompt itself comes from the engine's append-only history, not from the memory.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Generator, Sequence
from threading import Thread
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    CompletionResponse,
    MessageRole,
)
from llama_index.core.chat_engine.types import (
    AgentChatResponse,
    BaseChatEngine,
    StreamingAgentChatResponse,
)
from llama_index.core.memory import BaseMemory, ChatMemoryBuffer
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.llms.craft_vllm.base import REUSE_KEY, CraftVLLM
from llama_index.postprocessor.craft.base import CraftReorderResult
from llama_index.postprocessor.craft.nodes import KeySource, split_nodes

from craft_rag.engine.results import ReuseReport


class CraftChatEngine(BaseChatEngine):
    """Append-only multi-turn RAG over ``retriever`` and a :class:`CraftVLLM`.

    One instance is one conversation (``conversation_id``, a fresh uuid by default); turns are
    sequential. Each turn: retrieve, run ``node_postprocessors``, plan with CRAFT (reorder and
    drop chunks sent in earlier turns, reported on :attr:`last_reorder`), send the new chunks
    and the question to the engine appended to the conversation, store both messages in
    ``memory``. ``source_nodes`` of a response are this turn's new nodes followed by the
    retrieved nodes an earlier turn already put in the prompt. :attr:`last_reuse_report` holds
    the engine's report of the latest finished turn.

    ``chat_history=`` arguments cannot rewrite a conversation whose tokens already sit in the
    engine: passing one that differs from the memory raises ``ValueError`` (call :meth:`reset`
    to start over).
    """

    def __init__(
        self,
        retriever: BaseRetriever,
        llm: CraftVLLM,
        *,
        memory: BaseMemory | None = None,
        conversation_id: str | None = None,
        node_postprocessors: Sequence[BaseNodePostprocessor] = (),
        key_source: KeySource = "node_id",
        **sampling: Any,
    ) -> None:
        if not isinstance(llm, CraftVLLM):
            msg = f"CraftChatEngine needs a CraftVLLM, got {type(llm).__name__}"
            raise ValueError(msg)
        if not isinstance(retriever, BaseRetriever):
            msg = f"retriever must be a llama_index BaseRetriever, got {type(retriever).__name__}"
            raise ValueError(msg)
        self._retriever = retriever
        self._llm = llm
        self._memory = memory if memory is not None else ChatMemoryBuffer.from_defaults(llm=llm)
        self.conversation_id = conversation_id or f"llama-index-chat-{uuid.uuid4().hex}"
        self._postprocessors = list(node_postprocessors)
        self._key_source: KeySource = key_source
        self._reorderer = llm.reorderer(key_source=key_source)
        self._sampling = dict(sampling)
        llm._sampling(dict(sampling))  # validate names now
        self.last_reorder: CraftReorderResult | None = None
        self.last_reuse_report: ReuseReport | None = None

    @property
    def memory(self) -> BaseMemory:
        return self._memory

    @property
    def chat_history(self) -> list[ChatMessage]:
        return self._memory.get_all()

    def reset(self) -> None:
        """Forget the conversation: engine history, planner dedup state and memory."""
        self._llm.engine.end_conversation(self.conversation_id)
        self._memory.reset()
        self.last_reorder = None
        self.last_reuse_report = None

    # ---- one turn, shared by the four entry points ----

    def _check_history(self, chat_history: list[ChatMessage] | None) -> None:
        if chat_history is None:
            return
        current = self._memory.get_all()
        if [(m.role, m.content) for m in chat_history] != [(m.role, m.content) for m in current]:
            msg = (
                "CraftChatEngine keeps the conversation's prompt in the engine (append-only KV) "
                "and cannot replace its history; call reset() and replay the turns, or omit "
                "chat_history"
            )
            raise ValueError(msg)

    def _postprocess(self, nodes: list[NodeWithScore], bundle: QueryBundle) -> list[NodeWithScore]:
        for pp in self._postprocessors:
            nodes = pp.postprocess_nodes(nodes, query_bundle=bundle)
        return nodes

    async def _apostprocess(
        self, nodes: list[NodeWithScore], bundle: QueryBundle
    ) -> list[NodeWithScore]:
        for pp in self._postprocessors:
            nodes = await pp.apostprocess_nodes(nodes, query_bundle=bundle)
        return nodes

    def _plan(self, nodes: list[NodeWithScore], bundle: QueryBundle) -> tuple[Any, list[Any]]:
        result = self._reorderer.reorder(nodes, bundle, conversation_id=self.conversation_id)
        self.last_reorder = result
        chunks = list(split_nodes(result.nodes, self._key_source).chunks)
        sources = list(result.nodes) + list(result.removed_duplicates)
        return sources, chunks

    def _finish(self, response: CompletionResponse) -> None:
        report = response.additional_kwargs.get(REUSE_KEY)
        if isinstance(report, ReuseReport):
            self.last_reuse_report = report

    @staticmethod
    def _user(message: str) -> ChatMessage:
        if not isinstance(message, str) or not message.strip():
            msg = "message must be a non-empty string"
            raise ValueError(msg)
        return ChatMessage(role=MessageRole.USER, content=message)

    def chat(
        self, message: str, chat_history: list[ChatMessage] | None = None
    ) -> AgentChatResponse:
        user = self._user(message)
        self._check_history(chat_history)
        bundle = QueryBundle(message)
        nodes = self._postprocess(self._retriever.retrieve(bundle), bundle)
        sources, chunks = self._plan(nodes, bundle)
        done = self._llm.complete_chunks(
            chunks, message, conversation_id=self.conversation_id, **self._sampling
        )
        self._finish(done)
        self._memory.put(user)
        self._memory.put(ChatMessage(role=MessageRole.ASSISTANT, content=done.text))
        return AgentChatResponse(
            response=done.text, source_nodes=sources, metadata={REUSE_KEY: self.last_reuse_report}
        )

    async def achat(
        self, message: str, chat_history: list[ChatMessage] | None = None
    ) -> AgentChatResponse:
        user = self._user(message)
        self._check_history(chat_history)
        bundle = QueryBundle(message)
        nodes = await self._apostprocess(await self._retriever.aretrieve(bundle), bundle)
        sources, chunks = self._plan(nodes, bundle)
        done = await self._llm.acomplete_chunks(
            chunks, message, conversation_id=self.conversation_id, **self._sampling
        )
        self._finish(done)
        await self._memory.aput(user)
        await self._memory.aput(ChatMessage(role=MessageRole.ASSISTANT, content=done.text))
        return AgentChatResponse(
            response=done.text, source_nodes=sources, metadata={REUSE_KEY: self.last_reuse_report}
        )

    def _chat_deltas(
        self, stream: Generator[CompletionResponse, None, None]
    ) -> Generator[ChatResponse, None, None]:
        for r in stream:
            if REUSE_KEY in r.additional_kwargs:
                self._finish(r)
            yield ChatResponse(
                message=ChatMessage(role=MessageRole.ASSISTANT, content=r.text),
                delta=r.delta,
                raw=r.raw,
                additional_kwargs=r.additional_kwargs,
            )

    async def _achat_deltas(
        self, stream: AsyncGenerator[CompletionResponse, None]
    ) -> AsyncGenerator[ChatResponse, None]:
        async for r in stream:
            if REUSE_KEY in r.additional_kwargs:
                self._finish(r)
            yield ChatResponse(
                message=ChatMessage(role=MessageRole.ASSISTANT, content=r.text),
                delta=r.delta,
                raw=r.raw,
                additional_kwargs=r.additional_kwargs,
            )

    def stream_chat(
        self, message: str, chat_history: list[ChatMessage] | None = None
    ) -> StreamingAgentChatResponse:
        """Streams the reply; the assistant message reaches ``memory`` when the stream ends
        (LlamaIndex's writer thread, as in ``SimpleChatEngine``)."""
        user = self._user(message)
        self._check_history(chat_history)
        bundle = QueryBundle(message)
        nodes = self._postprocess(self._retriever.retrieve(bundle), bundle)
        sources, chunks = self._plan(nodes, bundle)
        self._memory.put(user)
        stream = self._llm.stream_complete_chunks(
            chunks, message, conversation_id=self.conversation_id, **self._sampling
        )
        response = StreamingAgentChatResponse(
            chat_stream=self._chat_deltas(stream), source_nodes=sources
        )
        thread = Thread(target=response.write_response_to_history, args=(self._memory,))
        response.write_response_to_history_thread = thread
        thread.start()
        return response

    async def astream_chat(
        self, message: str, chat_history: list[ChatMessage] | None = None
    ) -> StreamingAgentChatResponse:
        user = self._user(message)
        self._check_history(chat_history)
        bundle = QueryBundle(message)
        nodes = await self._apostprocess(await self._retriever.aretrieve(bundle), bundle)
        sources, chunks = self._plan(nodes, bundle)
        await self._memory.aput(user)
        stream = self._llm.astream_complete_chunks(
            chunks, message, conversation_id=self.conversation_id, **self._sampling
        )
        response = StreamingAgentChatResponse(
            achat_stream=self._achat_deltas(stream), source_nodes=sources
        )
        response.awrite_response_to_history_task = asyncio.create_task(
            response.awrite_response_to_history(self._memory)
        )
        return response
