"""``CraftConversation``: multi-turn RAG chat, append-only and deduplicated per session id.

Each turn: retrieve for the question, hand the documents to ``ChatCraftVLLM`` with the session
id as conversation id, and append the question and reply to the session's
``BaseChatMessageHistory``. The engine keeps the conversation's prompt append-only
(``[turn 1 chunks][Q1][A1][turn 2 new chunks][Q2]...``): every turn reuses all earlier turns'
KV, and a chunk sent in an earlier turn is not sent again (it is already in the prompt); the
reply's ``response_metadata["craft"]`` reports the removals and the cached tokens.

Not built on ``RunnableWithMessageHistory`` (deprecated in langchain-core 1.x): the history
is read and written here through three members of the ``BaseChatMessageHistory`` interface
(``messages``, ``add_messages``, ``clear``; see :class:`MessageHistory`), so any store works
(in-memory, Redis, SQL...) and so does a non-LangChain one (``BaseChatMessageHistory`` itself is
deprecated since langchain-core 1.6.4). The history is optional: it is the record for the
application; the engine's token history is the prompt. When the engine does not know a session
that has history (the process restarted, or the engine evicted the conversation), the first
turn served carries the earlier questions and answers as text, so the model keeps the context.

Follow-ups are condensed before retrieval (LangChain's ``create_history_aware_retriever``
step): from the second turn on, the engine rewrites the question into a standalone one on the
conversation's own cached prefix (:mod:`craft_rag.engine.condense`), the retriever gets the
rewrite, the prompt keeps the user's question, and ``response_metadata["craft_condense"]``
reports the rewrite and its own cost. ``condense=None`` (the default, auto) skips it on the
embedded models (135M/270M models answer or invent instead of rewriting) and reports
``method="off"`` with that reason; ``True``/``False`` force it.
The engine's ``HistoryBudget`` bounds the prompt history (oldest whole turns dropped; their
chunks are sent again when retrieved again).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from langchain_core.callbacks import (
    AsyncCallbackManagerForChainRun,
    CallbackManagerForChainRun,
)
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage
from langchain_core.runnables import Runnable, RunnableConfig, RunnableSerializable
from langchain_core.runnables.config import patch_config
from pydantic import ConfigDict, Field, model_validator

from craft_rag import DEFAULT_INSTRUCTIONS
from craft_rag.engine import (
    CONDENSE_INSTRUCTION,
    DEFAULT_CONDENSE_MAX_TOKENS,
    Condensed,
    acondense,
    condense,
    condense_off_reason,
)
from langchain_craft._documents import DEFAULT_CONVERSATION_KEYS, conversation_id_from_config
from langchain_craft._results import reuse_dict
from langchain_craft.chat_models import ChatCraftVLLM
from langchain_craft.prompt import CRAFT_CONTEXT_KEY, build_context

ConversationInput = str | Mapping[str, Any]


class MessageHistory(Protocol):
    """What a session history needs (``BaseChatMessageHistory`` has it)."""

    @property
    def messages(self) -> list[BaseMessage]: ...

    def add_messages(self, messages: Sequence[BaseMessage]) -> None: ...

    def clear(self) -> None: ...


class InMemoryHistory:
    """A plain in-process :class:`MessageHistory`: a list of messages, appended to in order
    (not a ``BaseChatMessageHistory``, which is deprecated since langchain-core 1.6.4). For
    examples and tests; a deployment passes a persistent store (Redis, SQL...)."""

    def __init__(self) -> None:
        self.messages: list[BaseMessage] = []

    def add_messages(self, messages: Sequence[BaseMessage]) -> None:
        self.messages.extend(messages)

    def clear(self) -> None:
        self.messages = []


@dataclass(frozen=True, slots=True)
class _Turn:
    """One prepared turn. Owner: the calling method."""

    session_id: str
    history: MessageHistory | None
    question: str
    documents: Sequence[Document] | None
    llm_kwargs: dict[str, Any] = field(repr=False)  # holds the cache_salt: never shown

    @property
    def cache_salt(self) -> str | None:
        salt = self.llm_kwargs.get("cache_salt")
        return salt if isinstance(salt, str) else None

    def previous_question(self) -> str | None:
        """The last human message of the session's history (the condense fallback)."""
        if self.history is None:
            return None
        humans = [m for m in self.history.messages if m.type == "human"]
        return humans[-1].text if humans else None


def _transcript(messages: Sequence[BaseMessage]) -> str:
    roles = {"human": "User", "ai": "Assistant", "system": "System"}
    return "\n".join(f"{roles.get(m.type, m.type)}: {m.text}" for m in messages)


class CraftConversation(RunnableSerializable[ConversationInput, AIMessage]):
    """Multi-turn RAG chat over ``ChatCraftVLLM``, one conversation per session id.

    Input: a question string, or a dict with ``question`` and optionally ``documents`` (use
    them instead of calling ``retriever``). Config: ``{"configurable": {"session_id": ...}}``
    (or ``conversation_id``/``thread_id``), required; ``cache_salt`` there (or the ``cache_salt``
    field) isolates the session's prefix-cache entries and planner from other salts (vLLM
    reuses KV only between requests with the same salt). A session is scoped by its salt (its
    tenant): the same session id under another salt is another tenant's session, with its own
    engine conversation; give ``get_session_history`` two parameters ``(session_id,
    cache_salt)`` so the message histories are per tenant too (a one-parameter factory gets
    the session id alone: right for one tenant, shared between tenants otherwise).
    Output: the reply ``AIMessage`` (``response_metadata["craft"]`` is the reuse report). Turns
    of one session must not overlap (the engine refuses a second turn in flight). Cost per
    turn: one retrieval plus one engine request whose uncached part is the new chunks, the
    question and the previous reply.
    """

    llm: ChatCraftVLLM = Field(
        description="The engine-backed chat model serving each turn; left out: a "
        "ChatCraftVLLM on the embedded model, started with system_prompt/context_prompt."
    )
    system_prompt: str | None = Field(
        default=None,
        description="System message at the head of every prompt: the engine's fixed head "
        "(shared by every session, so its KV is reused); must equal llm's (ValueError).",
    )
    context_prompt: str | None = Field(
        default=None,
        description="Text before the first document of each turn (the engine's instructions); "
        "must equal llm's (ValueError).",
    )
    get_session_history: (
        Callable[[str], MessageHistory] | Callable[[str, str | None], MessageHistory] | None
    ) = Field(
        default=None,
        description="Returns the message history of a session id, or of (session id, "
        "cache_salt) when it takes two parameters (per tenant; created when new); None: keep "
        "no history beyond the engine's.",
    )
    retriever: Runnable[str, list[Document]] | None = Field(
        default=None,
        description="Retrieves documents for each question; None: documents come in the input.",
    )
    conversation_keys: tuple[str, ...] = Field(
        default=DEFAULT_CONVERSATION_KEYS,
        description='Keys of config["configurable"] read as the session id.',
    )
    cache_salt: str | None = Field(
        default=None,
        description='Default cache salt; config["configurable"]["cache_salt"] overrides it.',
        repr=False,  # a tenant's key to its cache namespace: never shown
    )
    condense: bool | None = Field(
        default=None,
        strict=True,  # "yes" or 1 is a mistake here, not a truthy choice
        description="Rewrite follow-ups into standalone questions (on the conversation's "
        "cached prefix) before calling the retriever. None (auto): on, except when the engine "
        "serves an embedded model, too small to rewrite reliably.",
    )
    condense_prompt: str = Field(
        default=CONDENSE_INSTRUCTION,
        description="The condense instruction; must contain '{question}'.",
    )
    condense_max_tokens: int = Field(default=DEFAULT_CONDENSE_MAX_TOKENS, ge=1)

    model_config = ConfigDict(arbitrary_types_allowed=True, hide_input_in_errors=True)

    @model_validator(mode="before")
    @classmethod
    def _start_llm(cls, data: Any) -> Any:
        """No ``llm``: one on the embedded model whose engine renders the prompt head."""
        if isinstance(data, dict) and data.get("llm") is None:
            head = {k: data.get(k) for k in ("system_prompt", "context_prompt")}
            data = {**data, "llm": ChatCraftVLLM(**head)}
        return data

    @model_validator(mode="after")
    def _check_head(self) -> Any:
        """The prompt head belongs to the engine (every session shares it, so its KV is
        reused): a ``system_prompt``/``context_prompt`` other than the one ``llm``'s engine
        renders would be silently ignored, so it is a ``ValueError`` naming the fix."""
        llm, engine = self.llm, self.llm.engine
        if engine is not None:
            has = {"system_prompt": engine.system_prompt, "context_prompt": engine.instructions}
        else:
            context = llm.context_prompt
            has = {
                "system_prompt": llm.system_prompt,
                "context_prompt": DEFAULT_INSTRUCTIONS if context is None else context,
            }
        for name, value in (
            ("system_prompt", self.system_prompt),
            ("context_prompt", self.context_prompt),
        ):
            if value is not None and value != has[name]:
                msg = (
                    f"{name}={value!r} differs from the one llm's engine renders "
                    f"({has[name]!r}): the engine renders the head of every prompt, so build "
                    f"the model with it, ChatCraftVLLM({name}=...), or leave llm= out and "
                    "CraftConversation starts one"
                )
                raise ValueError(msg)
        return self

    # ---- shared by every path ---------------------------------------------------------------

    def _prepare(self, input: ConversationInput, config: RunnableConfig) -> _Turn:
        if isinstance(input, str):
            question, documents = input, None
        elif isinstance(input, Mapping):
            if "question" not in input:
                msg = f"CraftConversation input dict needs a 'question'; got keys {sorted(input)}"
                raise ValueError(msg)
            question, documents = input["question"], input.get("documents")
        else:
            msg = f"CraftConversation takes a question str or dict, got {type(input).__name__}"
            raise ValueError(msg)
        if not isinstance(question, str) or not question.strip():
            msg = f"question must be a non-empty string, got {question!r}"
            raise ValueError(msg)
        session_id = conversation_id_from_config(config, self.conversation_keys)
        if session_id is None:
            msg = (
                "CraftConversation needs a session id: invoke(..., config={'configurable': "
                f"{{'session_id': '...'}}}}) (any of {list(self.conversation_keys)})"
            )
            raise ValueError(msg)
        if documents is None and self.retriever is None:
            msg = "no retriever configured: pass {'question': ..., 'documents': [...]}"
            raise ValueError(msg)
        llm_kwargs: dict[str, Any] = {"conversation_id": session_id}
        salt = self._salt(config)
        if salt is not None:
            llm_kwargs["cache_salt"] = salt
        history = self._history(session_id, salt)
        return _Turn(session_id, history, question, documents, llm_kwargs)

    def _salt(self, config: RunnableConfig | None) -> Any:
        """The tenant of a call: ``config["configurable"]["cache_salt"]``, else the field."""
        return ((config or {}).get("configurable") or {}).get("cache_salt", self.cache_salt)

    def _history(self, session_id: str, salt: str | None) -> MessageHistory | None:
        """The session's message history (per tenant with a two-parameter factory)."""
        factory = self.get_session_history
        if factory is None:
            return None
        if _takes_two(factory):
            return cast("Callable[[str, str | None], MessageHistory]", factory)(session_id, salt)
        return cast("Callable[[str], MessageHistory]", factory)(session_id)

    def _prompt(self, turn: _Turn, documents: Sequence[Document]) -> list[BaseMessage]:
        question = turn.question
        earlier = turn.history.messages if turn.history is not None else []
        engine = self.llm.get_engine()
        if earlier and engine.turn_count(turn.session_id, cache_salt=turn.cache_salt) == 0:
            question = f"Earlier conversation:\n{_transcript(earlier)}\n\n{question}"
        context = build_context(documents, question, conversation_id=turn.session_id)
        return [HumanMessage(content=question, additional_kwargs={CRAFT_CONTEXT_KEY: context})]

    @staticmethod
    def _record(turn: _Turn, chunks: Sequence[AIMessageChunk]) -> None:
        if turn.history is not None:
            turn.history.add_messages([HumanMessage(content=turn.question), _aggregate(chunks)])

    @staticmethod
    def _child(config: RunnableConfig, run_manager: Any) -> RunnableConfig:
        return patch_config(config, callbacks=run_manager.get_child())

    # ---- one turn: invoke is the aggregated stream ------------------------------------------

    def _ckw(self, turn: _Turn) -> dict[str, Any]:
        """Keyword arguments of the condense step for ``turn``."""
        if "{question}" not in self.condense_prompt:
            msg = "condense_prompt must contain '{question}' where the follow-up goes"
            raise ValueError(msg)
        return {
            "cache_salt": turn.cache_salt,
            "max_tokens": self.condense_max_tokens,
            "instruction": self.condense_prompt,
            "previous": turn.previous_question(),
        }

    def _skipped(self, turn: _Turn) -> Condensed | None:
        """The turn's condense step when it is off (the follow-up as is, with the reason);
        ``None`` when the engine should condense it (:func:`condense_off_reason`)."""
        reason = condense_off_reason(self.llm.get_engine(), self.condense)
        return None if reason is None else Condensed.off(turn.question, reason)

    def _retriever(self) -> Runnable[str, list[Document]]:
        assert self.retriever is not None, "_prepare checks documents or a retriever"
        return self.retriever

    def _stream_turn(
        self,
        inputs: Iterator[ConversationInput],
        run_manager: CallbackManagerForChainRun,
        config: RunnableConfig,
    ) -> Iterator[AIMessageChunk]:
        turn = self._prepare(_single(inputs), config)
        child = self._child(config, run_manager)
        documents = turn.documents
        condensed: Condensed | None = None
        if documents is None:
            condensed = self._skipped(turn) or condense(
                self.llm.get_engine(), turn.session_id, turn.question, **self._ckw(turn)
            )
            query = condensed.question
            documents = self._retriever().invoke(query, child)
        chunks: list[AIMessageChunk] = []
        for chunk in self.llm.stream(self._prompt(turn, documents), child, **turn.llm_kwargs):
            chunks.append(_with_condense(_ai_chunk(chunk), condensed))
            yield chunks[-1]
        self._record(turn, chunks)

    async def _astream_turn(
        self,
        inputs: AsyncIterator[ConversationInput],
        run_manager: AsyncCallbackManagerForChainRun,
        config: RunnableConfig,
    ) -> AsyncIterator[AIMessageChunk]:
        turn = self._prepare(_single([item async for item in inputs]), config)
        child = self._child(config, run_manager)
        documents = turn.documents
        condensed: Condensed | None = None
        if documents is None:
            condensed = self._skipped(turn) or await acondense(
                self.llm.get_engine(), turn.session_id, turn.question, **self._ckw(turn)
            )
            query = condensed.question
            documents = await self._retriever().ainvoke(query, child)
        chunks: list[AIMessageChunk] = []
        prompt = self._prompt(turn, documents)
        async for chunk in self.llm.astream(prompt, child, **turn.llm_kwargs):
            chunks.append(_with_condense(_ai_chunk(chunk), condensed))
            yield chunks[-1]
        self._record(turn, chunks)

    def invoke(
        self, input: ConversationInput, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AIMessage:
        """One turn; the reply ``AIMessage``. Runs :meth:`stream` and joins the chunks."""
        return _aggregate(list(self.stream(input, config, **kwargs)))

    async def ainvoke(
        self, input: ConversationInput, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AIMessage:
        return _aggregate([c async for c in self.astream(input, config, **kwargs)])

    def stream(
        self, input: ConversationInput, config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[AIMessageChunk]:
        """Stream the reply; the turn is recorded in the history once the stream completes
        (a stream closed early records nothing, and the engine commits nothing)."""
        for chunk in self._transform_stream_with_config(iter([input]), self._stream_turn, config):
            yield cast("AIMessageChunk", chunk)

    async def astream(
        self, input: ConversationInput, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[AIMessageChunk]:
        async def one() -> AsyncIterator[ConversationInput]:
            yield input

        async for chunk in self._atransform_stream_with_config(one(), self._astream_turn, config):
            yield cast("AIMessageChunk", chunk)

    # ---- sessions ---------------------------------------------------------------------------

    def end_session(
        self,
        session_id: str,
        *,
        clear_history: bool = False,
        config: RunnableConfig | None = None,
    ) -> bool:
        """Forget a session in the engine (planner dedup state and prompt history); with
        ``clear_history`` also clear its message history. The session is the tenant's of
        ``config`` (its ``cache_salt``, as for a turn; default the ``cache_salt`` field): a
        session with the same id under another salt stays. True if the engine knew it."""
        salt = self._salt(config)
        known = self.llm.get_engine().end_conversation(session_id, cache_salt=salt)
        if clear_history:
            history = self._history(session_id, salt)
            if history is not None:
                history.clear()
        return bool(known)


def _takes_two(factory: Callable[..., MessageHistory]) -> bool:
    """Whether a history factory takes ``(session_id, cache_salt)`` (two positional
    parameters) rather than the session id alone."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the one-argument form
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return False
    return sum(1 for p in params if p.kind in positional) >= 2


def _single(inputs: Iterable[ConversationInput]) -> ConversationInput:
    items = list(inputs)
    if len(items) != 1:
        msg = f"CraftConversation streams one question at a time, got {len(items)} inputs"
        raise ValueError(msg)
    return items[0]


def condense_dict(condensed: Condensed) -> dict[str, Any]:
    """A :class:`Condensed` as JSON-ready metadata (``report`` as in ``"craft"``)."""
    return {
        "question": condensed.question,
        "original": condensed.original,
        "method": condensed.method,
        "reason": condensed.reason,
        "report": reuse_dict(condensed.report) if condensed.report is not None else None,
    }


def _with_condense(chunk: AIMessageChunk, condensed: Condensed | None) -> AIMessageChunk:
    """The last chunk (the one with the reuse report) also reports the condense step."""
    if condensed is not None and "craft" in chunk.response_metadata:
        chunk.response_metadata["craft_condense"] = condense_dict(condensed)
    return chunk


def _ai_chunk(chunk: BaseMessage) -> AIMessageChunk:
    assert isinstance(chunk, AIMessageChunk), "ChatCraftVLLM streams AIMessageChunks"
    return chunk


def _aggregate(chunks: Sequence[AIMessageChunk]) -> AIMessage:
    if not chunks:
        msg = "the reply stream ended without a chunk (closed early?)"
        raise RuntimeError(msg)
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    return AIMessage(
        content=full.text,
        usage_metadata=full.usage_metadata,
        response_metadata=dict(full.response_metadata),
        id=full.id,
    )
