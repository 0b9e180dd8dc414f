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
The engine bounds that history with its ``HistoryBudget`` (``ChatMemoryBuffer.token_limit``'s
role): oldest whole turns are dropped, and their chunks are sent again if retrieved again.

Follow-ups are condensed before retrieval, as ``CondensePlusContextChatEngine`` (LlamaIndex's
default chat mode) does: from the second turn on, the engine rewrites the message into a
standalone question on the conversation's own cached prefix (:mod:`craft_rag.engine.condense`),
retrieval uses it, and the prompt keeps the user's message. ``condense=False`` retrieves with
the raw message (``ContextChatEngine``'s behaviour); the default ``None`` does so only on the
embedded models, too small to rewrite (:func:`~craft_rag.engine.condense.condense_off_reason`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
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
from llama_index.llms.craft_vllm.calls import LEGACY_REUSE_KEY
from llama_index.llms.craft_vllm.reuse import REUSE_METADATA_KEY
from llama_index.llms.craft_vllm.streaming import _BlockingStreamResponse, _StreamResponse
from llama_index.postprocessor.craft import (
    CraftReorderPostprocessor,
    CraftReorderResult,
    KeySource,
    split_nodes,
)

from craft_rag import Chunk, Plan, validate_conversation_id
from craft_rag.engine import (
    CONDENSE_INSTRUCTION,
    DEFAULT_CONDENSE_MAX_TOKENS,
    Condensed,
    ReuseReport,
    acondense,
    condense,
    condense_off_reason,
)

CONDENSE_METADATA_KEY = "craft_condense"
"""Response metadata key of the turn's :class:`~craft_rag.engine.condense.Condensed` (the
question retrieval used and the condense request's own report)."""


class CraftChatEngine(BaseChatEngine):
    """Append-only multi-turn RAG over ``retriever`` and a :class:`CraftVLLM`.

    One instance is one conversation (``conversation_id``, a fresh uuid by default) in one
    cache namespace (``cache_salt``, default the LLM's; kept for the whole session: the
    conversation is that tenant's, and the same id under another salt is another tenant's
    conversation); turns are sequential. Each turn: retrieve, run ``node_postprocessors``,
    plan with CRAFT (the engine's planner for the salt: reorder and drop chunks sent in earlier
    turns, reported on :attr:`last_reorder`), send that plan's new chunks and the question to
    the engine with ``plan=`` (served as planned, appended to the conversation, committed with
    what vLLM reused), store both messages in ``memory``. ``source_nodes`` of a response are
    this turn's new nodes followed by the retrieved nodes an earlier turn already put in the
    prompt. :attr:`last_reuse_report` holds the engine's report of the latest finished turn;
    response ``metadata["craft_reuse"]`` holds it too, and ``metadata["craft_condense"]`` the
    condense step (:attr:`last_condense`).

    ``condense``: retrieve with the follow-up rewritten by the engine on the conversation's
    cached prefix (``condense_prompt`` holds ``{question}``; at most ``condense_max_tokens``),
    reported separately. ``None`` (auto): on, except on an embedded model (135M/270M models
    answer instead of rewriting); then ``craft_condense`` is ``method="off"`` with the reason.
    ``key_source`` (``None``: ``"content_hash"`` when the engine's planner shares a store
    with other workers, whose nodes have other random ids, else ``"node_id"``).

    Over several servers (a :class:`CraftVLLM` with ``server=[...]``) the engine plans each
    turn on the conversation's home replica (routed there; re-homed if it fails): every
    retrieved node is sent, :attr:`last_reorder` stays ``None`` and the turn's dedup is in its
    reuse report.

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
        cache_salt: str | None = None,
        node_postprocessors: Sequence[BaseNodePostprocessor] = (),
        key_source: KeySource | None = None,
        condense: bool | None = None,
        condense_prompt: str = CONDENSE_INSTRUCTION,
        condense_max_tokens: int = DEFAULT_CONDENSE_MAX_TOKENS,
        system_prompt: str | None = None,
        context_prompt: str | None = None,
        **sampling: Any,
    ) -> None:
        if not isinstance(llm, CraftVLLM):
            msg = f"CraftChatEngine needs a CraftVLLM, got {type(llm).__name__}"
            raise ValueError(msg)
        if not isinstance(retriever, BaseRetriever):
            msg = f"retriever must be a llama_index BaseRetriever, got {type(retriever).__name__}"
            raise ValueError(msg)
        if "cache_salt" in sampling:
            msg = "pass cache_salt= once (keyword of CraftChatEngine), not as a sampling setting"
            raise ValueError(msg)
        if "{question}" not in condense_prompt:
            msg = "condense_prompt must contain '{question}' where the follow-up goes"
            raise ValueError(msg)
        if not isinstance(condense_max_tokens, int) or condense_max_tokens < 1:
            msg = f"condense_max_tokens must be an int >= 1, got {condense_max_tokens!r}"
            raise ValueError(msg)
        _check_head(llm, system_prompt, context_prompt)
        self._pending_metadata: dict[str, Any] | None = None  # the stream being read
        self._condense_off = condense_off_reason(llm.engine, condense)  # None: condense
        self._condense_prompt = condense_prompt
        self._condense_max_tokens = condense_max_tokens
        self._retriever = retriever
        self._llm = llm
        self._memory = memory if memory is not None else ChatMemoryBuffer.from_defaults(llm=llm)
        conv = validate_conversation_id(conversation_id)  # None: a fresh id; 0/"": ValueError
        self.conversation_id = conv if conv is not None else f"llama-index-chat-{uuid.uuid4().hex}"
        self.cache_salt = cache_salt if cache_salt is not None else llm.cache_salt
        self._postprocessors = list(node_postprocessors)
        # Plans with the engine's planner for this salt; the plan is handed to the engine
        # directly (park=False: reserved at once, so no complete_chunks call finds it).
        # Several servers (llm.routed): no planner here; the engine fits, routes, plans and
        # commits each turn on the conversation's home replica. Content hashes then, so a
        # chunk's key is the same in every app worker.
        self._reorderer: CraftReorderPostprocessor | None = None
        if llm.routed:
            self._key_source: KeySource = key_source or "content_hash"
        else:
            self._reorderer = CraftReorderPostprocessor(
                planner=llm.planner_for(self.cache_salt),
                commit_mode="engine",
                key_source=key_source,
            )
            self._key_source = self._reorderer.key_source  # None resolved there
        self._sampling = {**sampling, "cache_salt": self.cache_salt}
        llm._options(dict(self._sampling))  # validate names and the salt now
        self.last_reorder: CraftReorderResult | None = None
        self.last_reuse_report: ReuseReport | None = None
        self.last_condense: Condensed | None = None

    @classmethod
    def from_index(
        cls,
        index: Any,
        llm: CraftVLLM | None = None,
        *,
        similarity_top_k: int = 5,
        **kwargs: Any,
    ) -> CraftChatEngine:
        """A chat engine over ``index.as_retriever(similarity_top_k=...)`` (any LlamaIndex
        index) and ``llm`` (default: a ``CraftVLLM`` on the embedded model, started now:
        seconds). ``kwargs`` are :class:`CraftChatEngine`'s."""
        as_retriever = getattr(index, "as_retriever", None)
        if not callable(as_retriever):
            msg = (
                "index must be a LlamaIndex index with as_retriever(), got "
                f"{type(index).__name__}"
            )
            raise ValueError(msg)
        if llm is None:
            # The prompt head belongs to the engine: the LLM started here gets it.
            llm = CraftVLLM(
                system_prompt=kwargs.get("system_prompt"),
                context_prompt=kwargs.get("context_prompt"),
            )
        return cls(as_retriever(similarity_top_k=similarity_top_k), llm, **kwargs)

    @property
    def memory(self) -> BaseMemory:
        return self._memory

    @property
    def chat_history(self) -> list[ChatMessage]:
        return self._memory.get_all()

    def reset(self) -> None:
        """Forget the conversation: engine history, planner dedup state and memory. Only this
        chat engine's tenant's (its ``cache_salt``): another tenant's conversation with the same
        id stays."""
        self._llm.engine.end_conversation(self.conversation_id, cache_salt=self.cache_salt)
        self._memory.reset()
        self.last_reorder = None
        self.last_reuse_report = None
        self.last_condense = None

    # ---- one turn, shared by the four entry points ----

    def _open(self, message: str, chat_history: list[ChatMessage] | None) -> _Turn:
        if not isinstance(message, str) or not message.strip():
            msg = "message must be a non-empty string"
            raise ValueError(msg)
        if chat_history is not None:
            current = self._memory.get_all()
            if [(m.role, m.content) for m in chat_history] != [
                (m.role, m.content) for m in current
            ]:
                msg = (
                    "CraftChatEngine keeps the conversation's prompt in the engine (append-only "
                    "KV) and cannot replace its history; call reset() and replay the turns, or "
                    "omit chat_history"
                )
                raise ValueError(msg)
        return _Turn(message, QueryBundle(message))

    def _condense_kwargs(self) -> dict[str, Any]:
        users = [m for m in self._memory.get_all() if m.role == MessageRole.USER]
        return {
            "cache_salt": self.cache_salt,
            "max_tokens": self._condense_max_tokens,
            "instruction": self._condense_prompt,
            "previous": str(users[-1].content) if users else None,
        }

    def _condensed(self, turn: _Turn, condensed: Condensed) -> _Turn:
        self.last_condense = condensed
        turn.condensed = condensed
        turn.bundle = QueryBundle(condensed.question)
        return turn

    def _plan(self, turn: _Turn, nodes: list[NodeWithScore]) -> _Turn:
        """Plan the retrieved nodes for this turn (nothing committed yet: the engine does).
        First make room: turns the engine drops to fit this one are forgotten by the planner,
        so the plan never removes a chunk whose turn is about to leave the prompt."""
        if self._reorderer is None:  # several servers: the engine plans (see __init__)
            self.last_reorder = None
            turn.sources = list(nodes)
            turn.chunks = list(split_nodes(nodes, self._key_source).chunks)
            turn.kwargs = {"conversation_id": self.conversation_id, **self._sampling}
            return turn
        max_tokens = int(self._sampling.get("max_tokens") or self._llm.max_tokens)
        self._llm.engine.fit_turn(
            split_nodes(nodes, self._key_source).chunks,
            turn.message,
            conversation_id=self.conversation_id,
            max_tokens=max_tokens,
            cache_salt=self.cache_salt,
        )
        result = self._reorderer.reorder(
            nodes, turn.bundle, conversation_id=self.conversation_id, park=False
        )
        turn.plan = result.plan
        with self._giving_up_on_failure(turn):
            self.last_reorder = result
            turn.sources = list(result.nodes) + list(result.removed_duplicates)
            turn.chunks = list(split_nodes(result.nodes, self._key_source).chunks)
            turn.kwargs = {
                "conversation_id": self.conversation_id,
                "plan": result.plan,
                **self._sampling,
            }
        return turn

    def _give_up(self, turn: _Turn) -> None:
        """The turn failed or was cut short: abort its plan. The engine only releases a plan
        handed to it with ``plan=`` (back to its holder, us), so without this the conversation
        keeps a plan in flight and refuses every later turn for ``conversation_ttl_s``. A plan
        already committed is left alone (``abort`` returns False). O(1)."""
        if turn.plan is not None and self._reorderer is not None:
            self._reorderer.planner.abort(turn.plan)

    @contextmanager
    def _giving_up_on_failure(self, turn: _Turn) -> Iterator[None]:
        try:
            yield
        except BaseException:  # errors, cancellation, a stream closed early: no plan left
            self._give_up(turn)
            raise

    def _prepare(self, message: str, chat_history: list[ChatMessage] | None) -> _Turn:
        turn = self._open(message, chat_history)
        if self._condense_off is not None:
            self._condensed(turn, Condensed.off(message, self._condense_off))
        else:
            engine = self._llm.engine
            self._condensed(
                turn, condense(engine, self.conversation_id, message, **self._condense_kwargs())
            )
        nodes = self._retriever.retrieve(turn.bundle)
        for pp in self._postprocessors:
            nodes = pp.postprocess_nodes(nodes, query_bundle=turn.bundle)
        return self._plan(turn, nodes)

    async def _aprepare(self, message: str, chat_history: list[ChatMessage] | None) -> _Turn:
        turn = self._open(message, chat_history)
        if self._condense_off is not None:
            self._condensed(turn, Condensed.off(message, self._condense_off))
        else:
            engine = self._llm.engine
            condensed = await acondense(
                engine, self.conversation_id, message, **self._condense_kwargs()
            )
            self._condensed(turn, condensed)
        nodes = await self._retriever.aretrieve(turn.bundle)
        for pp in self._postprocessors:
            nodes = await pp.apostprocess_nodes(nodes, query_bundle=turn.bundle)
        return self._plan(turn, nodes)

    def _stream_metadata(self, turn: _Turn) -> dict[str, Any]:
        """The metadata of a streamed turn: the condense step now; :meth:`_record` adds the
        report when the stream's last response arrives (turns are sequential)."""
        metadata: dict[str, Any] = {CONDENSE_METADATA_KEY: turn.condensed}
        self._pending_metadata = metadata
        return metadata

    def _record(self, response: CompletionResponse) -> ChatResponse:
        """One engine response as a chat delta; the last one's report becomes
        :attr:`last_reuse_report`."""
        report = response.additional_kwargs.get(REUSE_KEY)
        if isinstance(report, ReuseReport):
            self.last_reuse_report = report
            if self._pending_metadata is not None:
                self._pending_metadata.update(
                    {REUSE_METADATA_KEY: report, LEGACY_REUSE_KEY: report}
                )
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, content=response.text),
            delta=response.delta,
            raw=response.raw,
            additional_kwargs=response.additional_kwargs,
        )

    def _answer(self, turn: _Turn, done: CompletionResponse) -> AgentChatResponse:
        self._record(done)
        turn.reply = ChatMessage(role=MessageRole.ASSISTANT, content=done.text)
        return AgentChatResponse(
            response=done.text,
            source_nodes=turn.sources,
            metadata={
                REUSE_KEY: self.last_reuse_report,
                REUSE_METADATA_KEY: self.last_reuse_report,
                LEGACY_REUSE_KEY: self.last_reuse_report,  # deprecated alias
                CONDENSE_METADATA_KEY: turn.condensed,
            },
        )

    def chat(
        self, message: str, chat_history: list[ChatMessage] | None = None
    ) -> AgentChatResponse:
        turn = self._prepare(message, chat_history)
        with self._giving_up_on_failure(turn):
            done = self._llm.complete_chunks(*turn.args, **turn.kwargs)
        answer = self._answer(turn, done)
        self._memory.put_messages(turn.messages)
        return answer

    async def achat(
        self, message: str, chat_history: list[ChatMessage] | None = None
    ) -> AgentChatResponse:
        turn = await self._aprepare(message, chat_history)
        with self._giving_up_on_failure(turn):
            done = await self._llm.acomplete_chunks(*turn.args, **turn.kwargs)
        answer = self._answer(turn, done)
        await self._memory.aput_messages(turn.messages)
        return answer

    def _chat_deltas(
        self, turn: _Turn, stream: Generator[CompletionResponse, None, None]
    ) -> Generator[ChatResponse, None, None]:
        with self._giving_up_on_failure(turn):
            for r in stream:
                yield self._record(r)

    async def _achat_deltas(
        self, turn: _Turn, stream: AsyncGenerator[CompletionResponse, None]
    ) -> AsyncGenerator[ChatResponse, None]:
        with self._giving_up_on_failure(turn):
            async for r in stream:
                yield self._record(r)

    def stream_chat(
        self, message: str, chat_history: list[ChatMessage] | None = None
    ) -> StreamingAgentChatResponse:
        """Streams the reply; the assistant message reaches ``memory`` when the stream ends
        (LlamaIndex's writer thread, as in ``SimpleChatEngine``)."""
        turn = self._prepare(message, chat_history)
        with self._giving_up_on_failure(turn):
            self._memory.put(turn.user)
            stream = self._llm.stream_complete_chunks(*turn.args, **turn.kwargs)
        response = _BlockingStreamResponse(
            chat_stream=self._chat_deltas(turn, stream), source_nodes=turn.sources
        )
        response.metadata = self._stream_metadata(turn)
        thread = Thread(target=response.write_response_to_history, args=(self._memory,))
        response.write_response_to_history_thread = thread
        thread.start()
        return response

    async def astream_chat(
        self, message: str, chat_history: list[ChatMessage] | None = None
    ) -> StreamingAgentChatResponse:
        turn = await self._aprepare(message, chat_history)
        with self._giving_up_on_failure(turn):
            await self._memory.aput(turn.user)
            stream = self._llm.astream_complete_chunks(*turn.args, **turn.kwargs)
        response = _StreamResponse(
            achat_stream=self._achat_deltas(turn, stream), source_nodes=turn.sources
        )
        response.metadata = self._stream_metadata(turn)
        response.awrite_response_to_history_task = asyncio.create_task(
            response.awrite_response_to_history(self._memory)
        )
        return response


@dataclass(slots=True)
class _Turn:
    """One turn in the making. Owner: the entry point that opened it; ``_plan`` fills the
    request fields, ``_answer`` the reply."""

    message: str
    bundle: QueryBundle
    sources: list[NodeWithScore] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    reply: ChatMessage | None = None
    condensed: Condensed | None = None
    plan: Plan | None = None
    """The plan ``_plan`` made (reserved for this turn); aborted if the turn fails."""

    @property
    def user(self) -> ChatMessage:
        return ChatMessage(role=MessageRole.USER, content=self.message)

    @property
    def args(self) -> tuple[list[Chunk], str]:
        """``complete_chunks``'s positional arguments: the plan's new chunks, the question."""
        return self.chunks, self.message

    @property
    def messages(self) -> list[ChatMessage]:
        """What the turn adds to memory: the user message, then the reply once there is one."""
        return [self.user] if self.reply is None else [self.user, self.reply]


def _check_head(llm: CraftVLLM, system_prompt: str | None, context_prompt: str | None) -> None:
    """The system and context prompts are the engine's fixed prompt head (shared by every
    conversation, so its KV is reused): a chat engine can only ask for the head its LLM's
    engine renders. ``ValueError`` naming the fix otherwise."""
    for name, value, attribute in (
        ("system_prompt", system_prompt, "system_prompt"),
        ("context_prompt", context_prompt, "instructions"),
    ):
        has = getattr(llm.engine, attribute, None)
        if value is not None and value != has:
            msg = (
                f"{name}={value!r} differs from the LLM's engine ({attribute}={has!r}): the "
                f"engine renders the head of every prompt, so build the LLM with it, "
                f"CraftVLLM({name}=...), or leave llm= out and as_craft_chat_engine starts one"
            )
            raise ValueError(msg)


def as_craft_chat_engine(
    index: Any, llm: CraftVLLM | None = None, **kwargs: Any
) -> CraftChatEngine:
    """One call from an index to CRAFT chat (``index.as_chat_engine()``'s counterpart):
    :meth:`CraftChatEngine.from_index`."""
    return CraftChatEngine.from_index(index, llm, **kwargs)
