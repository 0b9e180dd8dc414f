"""``ChatCraftVLLM``: a LangChain chat model served by craft-rag's vLLM engine (in-process, or a
vLLM server).

What reaches the engine:

* a last ``HumanMessage`` carrying a :class:`~langchain_craft.prompt.CraftContext` (from
  :class:`~langchain_craft.CraftRAGPrompt` or :class:`~langchain_craft.CraftConversation`): its
  chunks and question, as separately tokenized segments; the engine plans them (order, dedup
  within the conversation), serves them, and commits the plan with what vLLM reused. A context
  holding a pending plan of the engine's own planner (``reorder_step()``) is served as that
  plan: the previewed order is the order served, and that plan is the one committed. With a
  conversation id the engine keeps the conversation's prompt append-only, so earlier messages
  of the list are not re-sent: the engine's history is the conversation;
* any other message list: a plain chat, rendered with the model's chat template (one
  tokenized segment per message, ``CraftEngine.stream_messages``), so a chat re-sent with more
  messages reuses the earlier messages' KV. Stateless: the list is the conversation, nothing
  is planned or committed, and ``conversation_id`` is not used.

Every request streams from the engine (one path for invoke and stream, sync and async), so
``on_llm_new_token`` fires per token either way. The last chunk carries ``usage_metadata`` (with
``input_token_details.cache_read`` = vLLM's cached tokens) and ``response_metadata["craft"]``:
the engine's reuse report (prompt/cached/predicted tokens, TTFT, chunk order, dedup removals,
``plan_id``, ``salted``).

The exact prompt (``{"text", "token_ids"}``) is known before generation: ``invoke``,
``stream``, ``ainvoke`` and ``astream`` submit the request first and put it in the run's
metadata under ``craft_prompt``, so ``on_chat_model_start(..., metadata=...)`` and tracers
record it; ``response_metadata["craft_prompt"]`` repeats it. (``generate``/``agenerate``
called directly, ``stream_events(version="v3")``, and a model with a ``rate_limiter``, which
must wait before the request starts, show it in the response only.) A call LangChain answers
without the model (an LLM-cache hit) aborts the started request: nothing is committed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from functools import partial
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import RunnableConfig

from craft_rag import CraftPlanner
from langchain_craft._documents import validate_conversation_id
from langchain_craft._engine import CraftEngineParams, EngineRequest
from langchain_craft._results import final_metadata, usage_metadata
from langchain_craft._started import (
    Call,
    StartedRequest,
    arun_started,
    astream_started,
    run_started,
    stream_started,
)
from langchain_craft.prompt import CraftContext, build_context, craft_context
from langchain_craft.reorder import CraftReorder

_LS_KWARGS = frozenset({"ls_structured_output_format", "structured_output_format"})
"""Call kwargs LangChain pops before ``_stream`` (its tracing of structured output)."""

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}
"""LangChain message types -> chat-template roles (a ``ChatMessage`` brings its own role)."""


def _role(message: BaseMessage) -> str:
    if isinstance(message, ChatMessage):
        return message.role
    return _ROLES.get(message.type, message.type)


def _text(message: BaseMessage, index: int) -> str:
    if isinstance(message.content, str):
        return message.content
    blocks = message.content
    if any(isinstance(b, dict) and b.get("type") not in (None, "text") for b in blocks):
        msg = (
            f"messages[{index}] holds non-text content; ChatCraftVLLM serves text only "
            "(the embedded model has no image/audio input)"
        )
        raise ValueError(msg)
    return message.text


class ChatCraftVLLM(CraftEngineParams, BaseChatModel):
    """Chat model over a ``CraftEngine`` (vLLM with prefix caching and CRAFT).

    Example::

        engine = CraftEngine()  # or let the model start the embedded default itself
        chain = {"context": retriever, "question": RunnablePassthrough()} | CraftRAGPrompt() \\
            | ChatCraftVLLM(engine=engine, max_tokens=64)
        msg = chain.invoke("Who wrote Hamlet?", {"configurable": {"session_id": "s1"}})
        msg.response_metadata["craft"]["cached_tokens"]

    Per-call ``invoke`` keyword arguments: ``max_tokens``, ``temperature``, ``top_p``,
    ``seed``, ``stop``, ``read_prefix_cache``, ``cache_salt``, ``conversation_id`` and
    ``documents`` (a RAG request without ``CraftRAGPrompt``). Not supported (standard tests
    skip them, see tests): tool calling, structured output, image/audio/PDF input.
    """

    streaming: bool = False
    """Accepted for compatibility; every call streams from the engine anyway."""

    @property
    def _llm_type(self) -> str:
        return "craft-vllm-chat"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        """Not supported: ``NotImplementedError`` saying why and what to use instead."""
        msg = (
            "ChatCraftVLLM does not call tools: the engine serves CRAFT-planned RAG prompts and "
            "the embedded SmolLM2-135M has no tool-calling chat template. Retrieve first and "
            "pass documents (CraftRAGPrompt, CraftConversation), or bind tools on a "
            "tool-calling chat model (e.g. langchain-openai's ChatOpenAI against a vLLM server "
            "started with --enable-auto-tool-choice) and keep ChatCraftVLLM for the RAG step"
        )
        raise NotImplementedError(msg)

    def get_num_tokens_from_messages(
        self, messages: list[BaseMessage], tools: Sequence[Any] | None = None
    ) -> int:
        """Prompt tokens of ``messages`` as a plain chat: the model's chat template with the
        generation prompt, as :meth:`CraftEngine.message_token_ids` renders it (starts the
        engine if it is not running). Messages carrying a CRAFT context count their text only.
        """
        if tools:
            return self.bind_tools(tools)  # type: ignore[no-any-return]
        chat = [(_role(m), _text(m, i)) for i, m in enumerate(messages)]
        return len(self.get_engine().message_token_ids(chat))

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = self._craft_ls_params(super()._get_ls_params(stop=stop, **kwargs), kwargs)
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params  # type: ignore[no-any-return]

    def _planner(self, cache_salt: str | None) -> CraftPlanner:
        if self.routed():
            msg = (
                "this model serves through several servers (server=[...]): the engine routes "
                "and plans every request on the chosen replica, so there is no one planner to "
                "preview with; leave reorder_step() out (the engine orders the documents)"
            )
            raise ValueError(msg)
        return self.get_engine().planner_for(cache_salt)

    def reorder_step(self, **kwargs: Any) -> CraftReorder:
        """A ``CraftReorder`` previewing this engine's order without committing
        (``commit=False`` on the planner of this model's ``cache_salt``): put it in front of
        this model to see the order before generation; the engine then serves exactly the
        previewed plan (``plan=``) and commits it with what vLLM reused. A per-call
        ``cache_salt`` other than the model's makes the engine refuse the plan
        (``RuntimeError``: it belongs to another salt's planner).

        Conversations: by default the preview ignores the conversation id (it reorders, never
        drops), and for a conversation turn the engine plans on its own in the previewed
        order. Pass ``keeps_earlier_chunks=True`` only when the step feeds ``CraftRAGPrompt |
        this model`` (the engine's append-only conversation): the preview then drops what
        earlier turns sent and is served as is; a conversation plan that is never served
        blocks the conversation's next plan (the planner allows one pending plan each)."""
        return CraftReorder(planner=self._planner(self.cache_salt), commit=False, **kwargs)

    # ---- the prompt before generation: LangChain's entry points, request started first ----------

    def invoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        """LangChain's ``invoke``, the request submitted first: ``on_chat_model_start`` and the
        run's metadata carry its prompt under ``craft_prompt`` (module docstring)."""
        started, config = self._start(input, config, stop, kwargs)
        run = partial(super().invoke, input, config, stop=stop, **kwargs)
        return run_started(started, run)

    async def ainvoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        """Async :meth:`invoke`."""
        started, config = self._start(input, config, stop, kwargs)
        run = partial(super().ainvoke, input, config, stop=stop, **kwargs)
        return await arun_started(started, run)

    def stream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> Iterator[AIMessageChunk]:
        """LangChain's ``stream``, the request submitted first (see :meth:`invoke`)."""
        started, config = self._start(input, config, stop, kwargs, stream_api="sync")
        yield from stream_started(
            started, super().stream(input, config, stop=stop, **kwargs)
        )

    async def astream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AIMessageChunk]:
        """Async :meth:`stream`."""
        started, config = self._start(input, config, stop, kwargs, stream_api="async")
        chunks = super().astream(input, config, stop=stop, **kwargs)
        async for chunk in astream_started(started, chunks):
            yield chunk

    def _start(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None,
        stop: list[str] | None,
        kwargs: dict[str, Any],
        *,
        stream_api: Literal["sync", "async"] | None = None,
    ) -> tuple[StartedRequest | None, RunnableConfig | None]:
        """The call's request started before LangChain's run (``_start_call``), unless
        LangChain will not call ``_stream`` from here: a ``stream`` that falls back on
        ``invoke`` (``streaming=False`` given, ``disable_streaming``), whose ``invoke`` starts
        it, or a ``rate_limiter``, which must let the request start."""
        if self.rate_limiter is not None:
            return None, config
        if stream_api is not None and not self._should_stream(
            async_api=stream_api == "async", **{**kwargs, "stream": True}
        ):
            return None, config
        return self._start_call(partial(self._prepared, input, stop, kwargs), config)

    def _prepared(
        self, input: LanguageModelInput, stop: list[str] | None, kwargs: dict[str, Any]
    ) -> tuple[Call, Callable[[], EngineRequest]]:
        """The call as LangChain hands it to ``_stream`` (its messages; the kwargs without
        the ones it pops) and its request's builder."""
        messages = self._convert_input(input).to_messages()
        call_kwargs = {k: v for k, v in kwargs.items() if k not in _LS_KWARGS}
        return (messages, stop, call_kwargs), partial(self._request, messages, stop, call_kwargs)

    # ---- messages -> one engine request --------------------------------------------------------

    def _request(
        self, messages: Sequence[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> EngineRequest:
        if not messages:
            msg = "ChatCraftVLLM needs at least one message"
            raise ValueError(msg)
        texts = [_text(m, i) for i, m in enumerate(messages)]
        conversation_id = kwargs.get("conversation_id")
        context = craft_context(messages[-1])
        documents = kwargs.get("documents")
        if context is None and documents is not None:
            if not isinstance(messages[-1], HumanMessage):
                msg = "documents= needs the last message to be the human question"
                raise ValueError(msg)
            context = build_context(documents, texts[-1], conversation_id=conversation_id)
        if context is not None:
            return self._context_request(context, conversation_id, stop, kwargs)
        if not any(t.strip() for t in texts):
            msg = "the messages hold no text to answer"
            raise ValueError(msg)
        chat = [(_role(m), t) for m, t in zip(messages, texts, strict=True)]
        if self.system_prompt and chat[0][0] != "system":
            # The engine's head covers RAG prompts; a plain chat gets it as its system message.
            chat.insert(0, ("system", self.system_prompt))
        return self._engine_request((), "", None, stop, kwargs, messages=chat)

    def _context_request(
        self,
        context: CraftContext,
        conversation_id: str | None,
        stop: list[str] | None,
        kwargs: dict[str, Any],
    ) -> EngineRequest:
        if conversation_id is None:
            conversation_id = context.conversation_id
        if self.routed():  # several servers: the engine routes, plans and commits
            return self._engine_request(
                context.chunks, context.question, conversation_id, stop, kwargs
            )
        planner = self._planner(kwargs.get("cache_salt", self.cache_salt))
        if context.committed_by is not None and planner.made(context.committed_by):
            msg = (
                "these documents were already committed to the engine's planner by "
                "CraftReorder(commit=True); in front of ChatCraftVLLM use "
                "CraftReorder(planner=engine.planner, commit=False) (see "
                "ChatCraftVLLM.reorder_step()) or no reorder step: the engine plans and "
                "commits with what vLLM actually reused"
            )
            raise ValueError(msg)
        conversation_id = validate_conversation_id(conversation_id)
        # A pending plan of this request's planner and conversation is handed to the engine
        # by its ref: the engine claims it, serves it as is (the previewed order) and commits
        # it; any other plan is only an order hint.
        plan = context.plan
        ref = None
        if plan is not None and planner.made(plan) and plan.conversation_id == conversation_id:
            ref = plan.ref
        return self._engine_request(
            context.chunks, context.question, conversation_id, stop, kwargs, plan=ref
        )

    # ---- streaming is the one path -------------------------------------------------------------

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        call, build = (messages, stop, kwargs), partial(self._request, messages, stop, kwargs)
        yield from self._engine_stream(call, build, self._to_chunk, run_manager)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        call, build = (messages, stop, kwargs), partial(self._request, messages, stop, kwargs)
        async for chunk in self._engine_astream(call, build, self._to_chunk, run_manager):
            yield chunk

    def _to_chunk(self, piece: Any) -> ChatGenerationChunk:
        if piece.result is None:
            return ChatGenerationChunk(message=AIMessageChunk(content=piece.text))
        metadata = final_metadata(
            piece.result, self.served_model_name(), self.sent_prompt(piece.result)
        )
        return ChatGenerationChunk(
            message=AIMessageChunk(
                content=piece.text,
                usage_metadata=usage_metadata(piece.result),
                response_metadata=metadata,
                chunk_position="last",
            ),
            generation_info=metadata,
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        chunks = list(self._stream(messages, stop, run_manager, **kwargs))
        return _to_result(chunks)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        chunks = [c async for c in self._astream(messages, stop, run_manager, **kwargs)]
        return _to_result(chunks)


def _to_result(chunks: list[ChatGenerationChunk]) -> ChatResult:
    last = chunks[-1].message if chunks else None
    assert isinstance(last, AIMessageChunk) and last.chunk_position == "last", "stream ended early"
    text = "".join(c.message.text for c in chunks)
    message = AIMessage(
        content=text,
        usage_metadata=last.usage_metadata,
        response_metadata=dict(last.response_metadata),
    )
    return ChatResult(
        generations=[ChatGeneration(message=message, generation_info=chunks[-1].generation_info)]
    )
