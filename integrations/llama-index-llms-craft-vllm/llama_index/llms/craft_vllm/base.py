"""CraftVLLM: a LlamaIndex LLM backed by craft-rag's vLLM engine (``CraftEngine``, in-process or
over a vLLM server).

Two kinds of calls:

* the ordinary LLM interface (``complete``/``chat`` and their streaming and async forms) for
  free-form prompts: a chat goes to ``CraftEngine.generate_messages`` (the model's chat
  template, one tokenized segment per message, so a longer chat reuses the earlier messages'
  KV token for token); a formatted prompt to ``generate_tokens``;
* the chunk interface (``complete_chunks`` and its forms) for RAG: chunks and a question go to
  the engine as they are, rendered token-exactly in CRAFT's order and, given a conversation
  id, appended to the conversation's earlier turns. Every such request serves a plan with
  ``plan=``: the one a :meth:`CraftVLLM.reorderer` postprocessor parked for these chunks, the
  one the caller passes (the chat engine), or a fresh one from the engine's planner.
  :class:`~.synthesizer.CraftSynthesizer` and :class:`~.chat_engine.CraftChatEngine` use it.

Every response carries the engine's :class:`craft_rag.engine.results.ReuseReport` in
``additional_kwargs["craft_reuse"]`` (``"reuse_report"``: deprecated alias), the exact prompt
sent in ``additional_kwargs["craft_prompt"]`` (text and token ids; also a
:class:`~.calls.CraftPromptEvent` on the dispatcher) and the full ``GenerationResult`` in
``raw``; a query engine's ``Response.metadata["craft_reuse"]`` gets the report too, whatever
synthesizer it uses (:mod:`~llama_index.llms.craft_vllm.reuse`). The constructor takes
LlamaIndex's familiar names (``model``, ``api_base``, ``context_window``, ``max_new_tokens``,
``vllm_kwargs``, ...: :mod:`~.arguments`) and refuses unknown ones. Streaming
is real: each delta is yielded when the engine's driver thread produces it; the last streamed
response (empty delta) carries the report. All twelve entry points go through
:mod:`~llama_index.llms.craft_vllm.calls`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr, field_validator
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM
from llama_index.core.llms.llm import (
    default_completion_to_prompt as _identity_completion_to_prompt,
)
from llama_index.llms.craft_vllm.arguments import (
    EMBEDDED_MODEL_NAME,
    check_given_engine,
    sort_arguments,
)
from llama_index.llms.craft_vllm.calls import (
    REUSE_KEY,
    EngineCall,
    arespond,
    arespond_stream,
    chat_response,
    completion_response,
    respond,
    respond_stream,
)
from llama_index.llms.craft_vllm.prompts import chat_turns, chunk_list, completion_ids
from llama_index.llms.craft_vllm.reorderer import EngineReorderer
from llama_index.llms.craft_vllm.reuse import install_reuse_metadata
from llama_index.postprocessor.craft import CraftReorderPostprocessor

from craft_rag import (
    DEFAULT_INSTRUCTIONS,
    Chunk,
    CraftPlanner,
    Plan,
    check_text,
    validate_conversation_id,
)
from craft_rag.engine import (
    CraftEngine,
    EngineSettings,
    MessagesRequest,
    RagRequest,
    RoutedEngine,
    SamplingRequest,
    ServerSettings,
    TokensRequest,
    validate_cache_salt,
)
from craft_rag.engine.model_args import call_sampling, check_prompt_text

__all__ = ["EMBEDDED_MODEL_NAME", "REUSE_KEY", "CraftVLLM"]

_ROUTED_PLANS = (
    "this CraftVLLM serves through several servers (server=[...]): the engine routes and "
    "plans every request on the chosen replica, so there is no one planner and plans cannot "
    "come from outside; call complete_chunks(chunks, question) without plan= and without "
    "llm.reorderer() (CraftChatEngine does this by itself)"
)

_CONTEXT_KWARGS = frozenset({"cache_salt", "formatted"})
"""Per-call keyword arguments that are not sampling (the rest go to ``with_overrides``)."""


class CraftVLLM(LLM):
    """LlamaIndex LLM over one :class:`craft_rag.engine.engine.CraftEngine`.

    Pass a running ``engine`` (shared, not closed by this object), or ``model=`` (a local
    folder or a hub id) and/or ``engine_settings`` (an ``EngineSettings`` or a dict of its
    fields; nothing: the embedded default model) to start one that :meth:`close` stops; with
    ``api_base=``/``base_url=``/``server=`` (``http://HOST:PORT``, ``/v1`` or not) that engine
    serves through a vLLM OpenAI-compatible server (``model``: the local copy of the served
    model, whose tokenizer builds the prompt; see ``craft-rag serve``); a list of them
    (``server=[url, url, ...]``, optionally ``routing=``) serves through several replicas of
    that model: ``CraftEngine(server=[...], routing=...)`` routes and orders each request
    (docs/deployment.md). ``context_window``,
    ``vllm_kwargs``, ``dtype``... shape the started engine; ``max_new_tokens`` is
    ``max_tokens``; ``top_k``, ``presence_penalty``... (and ``additional_kwargs``) go to vLLM's
    sampling; ``system_prompt``/``context_prompt`` are the head of every prompt of the started
    engine (with ``engine=``: must equal the engine's). An unknown argument is a
    ``ValueError`` listing the accepted ones.

    The engine's state is left alone: requests are planned and committed by the engine's
    planner for :attr:`cache_salt` (``engine.planner_for(cache_salt)``, which must be a
    ``craft_rag.CraftPlanner``), conversation histories survive, and several ``CraftVLLM`` s
    may share one engine. To plan with another policy, call ``engine.set_planner(...)`` before
    building the LLM (that is the engine's decision: it forgets conversation histories).
    Plans made by :meth:`reorderer` postprocessors wait in the planner (pending leases) until
    :meth:`complete_chunks` reserves one by its chunk keys and the engine claims it by id.
    Thread-safe as far as the engine is (one driver thread serialises vLLM).
    """

    # Validation errors must not quote their input: a cache_salt is a tenant's key.
    model_config = ConfigDict(hide_input_in_errors=True)

    model: str = Field(
        default=EMBEDDED_MODEL_NAME,
        description=(
            "The model served: a local folder or a hub id, selected when this LLM starts its "
            "engine (with engine=: must name the engine's model); LLMMetadata.model_name."
        ),
    )
    max_tokens: int = Field(default=64, gt=0, description="Default max new tokens per request.")
    temperature: float = Field(
        default=0.0, ge=0.0, allow_inf_nan=False, description="Sampling temperature."
    )
    top_p: float = Field(
        default=1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling p."
    )
    seed: int | None = Field(default=None, description="Per-request sampling seed.")
    stop: list[str] | None = Field(default=None, description="Stop strings.")
    additional_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="vLLM sampling parameters passed on (top_k, min_p, penalties, ...).",
    )
    context_prompt: str | None = Field(
        default=None,
        description=(
            "Text before the first document of every RAG prompt of the engine this LLM starts "
            "(CraftEngine(instructions=...)); None: the default instructions."
        ),
    )
    read_prefix_cache: bool = Field(
        default=True,
        description="False: compute every prompt in full (the no-cache baseline on one engine).",
    )
    cache_salt: str | None = Field(
        default=None,
        description=(
            "vLLM cache salt of every request (a tenant or user): KV is reused only between "
            "requests with the same salt, and each salt has its own CRAFT planner. None: the "
            "shared namespace. A call's cache_salt= keyword overrides it."
        ),
        repr=False,  # a tenant's key to its cache namespace: never shown
    )

    _engine: CraftEngine = PrivateAttr()
    _owns_engine: bool = PrivateAttr(default=False)

    def __init__(
        self,
        engine: CraftEngine | None = None,
        *,
        engine_settings: EngineSettings | Mapping[str, Any] | None = None,
        server: str | ServerSettings | Sequence[str | ServerSettings] | None = None,
        routing: str | None = None,
        **data: Any,
    ) -> None:
        if "planner" in data:
            msg = (
                "CraftVLLM no longer installs a planner (that made the engine forget its "
                "conversations); it plans with engine.planner_for(cache_salt). Call "
                "engine.set_planner(planner) yourself before building the LLM"
            )
            raise ValueError(msg)
        if engine is not None and not isinstance(engine, CraftEngine):
            msg = f"engine must be a craft_rag CraftEngine, got {type(engine).__name__}"
            raise ValueError(msg)
        if routing is not None and engine is not None:
            msg = (
                "engine= is a running engine and routes as it was built; pass routing= "
                "without engine="
            )
            raise ValueError(msg)
        given_model = data.get("model")
        args = sort_arguments(
            data,
            set(type(self).model_fields),
            engine_given=engine is not None,
            engine_settings=engine_settings,
            server=server,
        )
        super().__init__(**args.fields)  # validates cache_salt before an engine is started
        check_prompt_text(self.system_prompt, "system_prompt")
        check_prompt_text(self.context_prompt, "context_prompt")
        owns = engine is None
        if engine is None:
            assert args.settings is not None
            instructions = DEFAULT_INSTRUCTIONS if self.context_prompt is None else (
                self.context_prompt
            )
            engine = CraftEngine(
                args.settings,
                server=list(args.server) if isinstance(args.server, tuple) else args.server,
                routing=routing,
                system_prompt=self.system_prompt,
                instructions=instructions,
            )
        else:
            check_given_engine(engine, given_model, self.system_prompt, self.context_prompt)
        if given_model is None and engine.settings.model is not None:
            self.model = str(engine.settings.model)
        self._engine = engine
        self._owns_engine = owns
        if not self.routed:
            self.planner_for(self.cache_salt)  # fail now if it plans with something else
        # Reports reach Response.metadata["craft_reuse"] on any synthesizer (see reuse.py).
        install_reuse_metadata()

    @field_validator("cache_salt")
    @classmethod
    def _check_salt(cls, value: str | None) -> str | None:
        validate_cache_salt(value)
        return value

    @classmethod
    def class_name(cls) -> str:
        return "CraftVLLM"

    # ---- handles ----

    @property
    def engine(self) -> CraftEngine:
        return self._engine

    @property
    def routed(self) -> bool:
        """Whether the engine serves through several servers (``server=[...]``): it then
        routes, plans and commits every chunk request itself (no plans from outside). O(1)."""
        return isinstance(self._engine, RoutedEngine)

    @property
    def planner(self) -> CraftPlanner:
        """The engine's planner for :attr:`cache_salt` (shared with :meth:`reorderer`)."""
        return self.planner_for(self.cache_salt)

    def planner_for(self, cache_salt: str | None) -> CraftPlanner:
        """The engine's planner for ``cache_salt`` (created on first use). ``ValueError`` for a
        bad salt, when the engine plans with something other than a ``CraftPlanner``, or when
        it serves several servers (each replica has its own planner; the engine plans). O(1)."""
        if self.routed:
            raise ValueError(_ROUTED_PLANS)
        planner = self._engine.planner_for(cache_salt)
        if not isinstance(planner, CraftPlanner):
            msg = (
                f"the engine plans with a {type(planner).__name__}; CraftVLLM needs a "
                "craft_rag.CraftPlanner: engine.set_planner(CraftPlanner(...))"
            )
            raise ValueError(msg)
        return planner

    def reorderer(
        self, *, max_tokens: int | None = None, **settings: Any
    ) -> CraftReorderPostprocessor:
        """A :class:`CraftReorderPostprocessor` wired to this LLM: the engine's planner for
        :attr:`cache_salt`, ``commit_mode="engine"``: its plans stay pending in that planner
        until :meth:`complete_chunks` reserves them (by chunk keys) for the engine.
        ``settings`` are its other fields (``key_source``, ``conversation_id``,
        ``keeps_earlier_chunks``). Build it after any
        ``engine.set_planner``: it keeps the planner it was built with.

        A conversation id only reorders unless ``keeps_earlier_chunks=True``: a query engine
        with LlamaIndex's own synthesizer sends this turn's nodes only, so nothing may be
        dropped as "sent earlier" (``craft_query_engine`` sets it: its synthesizer serves the
        engine's append-only conversation). Such a turn is fitted by the engine before it is
        planned (``engine.fit_turn`` for ``max_tokens``, default :attr:`max_tokens`: pass the
        synthesizer's): the turns another worker served are loaded from a shared store and
        the turns that no longer fit are dropped first, so dedup only removes chunks the
        rendered prompt carries (:class:`~.reorderer.EngineReorderer`)."""
        if self.routed:
            raise ValueError(_ROUTED_PLANS)
        for name in ("planner", "commit_mode"):
            if name in settings:
                msg = (
                    f"{name} is set by CraftVLLM.reorderer(); pass only key_source/conversation_id"
                )
                raise ValueError(msg)
        settings.setdefault("keeps_earlier_chunks", False)
        return EngineReorderer(
            self._engine,
            planner=self.planner,
            cache_salt=self.cache_salt,
            max_tokens=self.max_tokens if max_tokens is None else max_tokens,
            **settings,
        )

    def close(self) -> None:
        """Stop the engine if this object started it (a shared engine is left running)."""
        if self._owns_engine:
            self._engine.close()

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._engine.max_model_len,
            num_output=self.max_tokens,
            is_chat_model=True,
            is_function_calling_model=False,
            model_name=self.model,
        )

    # ---- requests: arguments -> one EngineCall ----

    def _options(self, kwargs: dict[str, Any]) -> tuple[SamplingRequest, str | None]:
        """A call's sampling (this LLM's fields with the call's keyword arguments over them:
        ``SamplingRequest.with_overrides``) and cache salt (``cache_salt=None``: the unsalted
        namespace). ``ValueError`` naming an unknown keyword, or for a bad salt."""
        base = SamplingRequest(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(self.stop or ()),
            read_prefix_cache=self.read_prefix_cache,
            extra=self.additional_kwargs,
        )
        call = {k: v for k, v in kwargs.items() if k not in _CONTEXT_KWARGS}
        sampling = base.with_overrides(**call_sampling(call, self.additional_kwargs))
        return sampling, validate_cache_salt(kwargs.get("cache_salt", self.cache_salt))

    def _messages_call(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> EngineCall:
        turns = chat_turns(messages, self.system_prompt)
        sampling, salt = self._options(kwargs)
        return EngineCall.of(self._engine, MessagesRequest(turns, salt, sampling))

    def _prompt_call(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> EngineCall:
        if not isinstance(prompt, str) or not prompt:
            msg = "prompt must be a non-empty string"
            raise ValueError(msg)
        check_text(prompt, "prompt")
        to_prompt = self.completion_to_prompt
        if to_prompt is _identity_completion_to_prompt:
            to_prompt = None
        if not formatted and to_prompt is None:
            # An instruct model: a bare prompt is one user message in its chat template.
            return self._messages_call([ChatMessage(role=MessageRole.USER, content=prompt)], kwargs)
        # The prompt (retrieved text included) is plain text; only completion_to_prompt's own
        # wrapping may hold control tokens.
        wrap = to_prompt if not formatted else None
        ids = completion_ids(self._engine.tokenizer, prompt, wrap)
        sampling, salt = self._options(kwargs)
        return EngineCall.of(self._engine, TokensRequest(ids, salt, sampling))

    def _chunks_call(
        self,
        chunks: Sequence[Chunk],
        question: str,
        kwargs: dict[str, Any],
    ) -> EngineCall:
        """The call of :meth:`complete_chunks` (``kwargs``: ``conversation_id``, ``plan``,
        sampling fields, ``cache_salt``). The plan to serve: ``plan``, else the one parked for
        exactly these chunk keys (in order) and conversation by a :meth:`reorderer` (only for
        this LLM's own salt, whose planner made it), else a fresh plan from the salt's
        planner."""
        conversation_id, plan = kwargs.pop("conversation_id", None), kwargs.pop("plan", None)
        if not isinstance(question, str) or not question.strip():
            msg = "question must be a non-empty string"
            raise ValueError(msg)
        check_text(question, "question")
        chunks = chunk_list(chunks)  # read once (a generator works), checked before planning
        conversation_id = validate_conversation_id(conversation_id)
        sampling, salt = self._options(kwargs)
        if self.routed:
            if plan is not None:
                raise ValueError(_ROUTED_PLANS)
            # The engine routes, plans (on the chosen replica's tree), commits and finishes.
            request = RagRequest(chunks, question, conversation_id, salt, None, sampling)
            return EngineCall.of(self._engine, request)
        if plan is not None:  # the caller's: it aborts the plan if the request fails
            request = RagRequest(plan.ordered, question, conversation_id, salt, plan, sampling)
            return EngineCall.of(self._engine, request, plan)
        planner = self.planner_for(salt)
        if salt == self.cache_salt:
            plan = planner.reserve(conversation_id, [c.key for c in chunks])
        if plan is None:
            plan = planner.plan(list(chunks), conversation_id)
        request = RagRequest(plan.ordered, question, conversation_id, salt, plan, sampling)
        # Found or made here: a failed request aborts it (else the conversation keeps a plan
        # in flight and refuses its next turn for conversation_ttl_s).
        return EngineCall.of(self._engine, request, plan, functools.partial(planner.abort, plan))

    # ---- LlamaIndex LLM interface: free-form prompts ----

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return respond(self._prompt_call(prompt, formatted, kwargs), completion_response)

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        return respond_stream(self._prompt_call(prompt, formatted, kwargs), completion_response)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return respond(self._messages_call(messages, kwargs), chat_response)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return respond_stream(self._messages_call(messages, kwargs), chat_response)

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        return await arespond(self._prompt_call(prompt, formatted, kwargs), completion_response)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        return arespond_stream(self._prompt_call(prompt, formatted, kwargs), completion_response)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await arespond(self._messages_call(messages, kwargs), chat_response)

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        return arespond_stream(self._messages_call(messages, kwargs), chat_response)

    # ---- the chunk interface: RAG through CRAFT ----

    def complete_chunks(
        self,
        chunks: Sequence[Chunk],
        question: str,
        *,
        conversation_id: str | None = None,
        plan: Plan | None = None,
        **kwargs: Any,
    ) -> CompletionResponse:
        """Answer ``question`` over ``chunks`` as one token-exact CRAFT prompt. Blocks.

        Serves ``plan`` (made by ``planner_for(cache_salt).plan(chunks, conversation_id)``;
        ``chunks`` must be its ordered chunks), else a plan a :meth:`reorderer` parked for
        exactly these chunks, else a fresh plan; the engine commits it once the request
        finished and a ``CraftCommitEvent(source="engine")`` reports that. ``kwargs``: sampling
        fields and ``cache_salt``. ``ValueError`` for an empty question, a prompt that cannot
        fit or a plan that does not fit; ``RuntimeError`` for a plan already committed, stale
        or made by another salt's planner.
        """
        kwargs.update(conversation_id=conversation_id, plan=plan)
        return respond(self._chunks_call(chunks, question, kwargs), completion_response)

    def stream_complete_chunks(
        self, chunks: Sequence[Chunk], question: str, **kwargs: Any
    ) -> CompletionResponseGen:
        """Streaming :meth:`complete_chunks` (same arguments; the plan is chosen now). The
        request starts when the generator is first advanced; closing it early aborts the
        request (nothing committed)."""
        return respond_stream(self._chunks_call(chunks, question, kwargs), completion_response)

    async def acomplete_chunks(
        self, chunks: Sequence[Chunk], question: str, **kwargs: Any
    ) -> CompletionResponse:
        """Async :meth:`complete_chunks` (same arguments; the event loop never blocks on the
        engine)."""
        return await arespond(self._chunks_call(chunks, question, kwargs), completion_response)

    def astream_complete_chunks(
        self, chunks: Sequence[Chunk], question: str, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        """Async streaming :meth:`complete_chunks` (same arguments)."""
        return arespond_stream(self._chunks_call(chunks, question, kwargs), completion_response)
