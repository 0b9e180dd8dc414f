"""CraftVLLM: a LlamaIndex LLM backed by craft-rag's in-process vLLM engine (``CraftEngine``).

Two kinds of calls:

* the ordinary LLM interface (``complete``/``chat`` and their streaming and async forms) for
  free-form prompts, rendered with the model's chat template (see :mod:`.raw`);
* the chunk interface (``complete_chunks`` and its forms) for RAG: chunks and a question go to
  the engine as they are, rendered token-exactly with CRAFT's order and, given a conversation
  id, appended to the conversation's earlier turns. :class:`~.synthesizer.CraftSynthesizer` and
  :class:`~.chat_engine.CraftChatEngine` use it.

Every response carries the engine's :class:`craft_rag.engine.results.ReuseReport` in
``additional_kwargs["reuse_report"]`` and the full ``GenerationResult`` in ``raw``. Streaming
is real: each delta is yielded when the engine's driver thread produces it; the last streamed
response (empty delta) carries the report.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
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
    TextBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM
from llama_index.core.llms.llm import (
    default_completion_to_prompt as _identity_completion_to_prompt,
)
from llama_index.llms.craft_vllm.planner import HandoffPlanner
from llama_index.llms.craft_vllm.raw import ChatRenderer, RawPromptRunner
from llama_index.postprocessor.craft.base import CraftReorderPostprocessor

from craft_rag import Chunk, CraftPlanner
from craft_rag.engine.engine import CraftEngine, EngineSettings
from craft_rag.engine.model import resolve_model
from craft_rag.engine.results import GenerationResult, SamplingRequest, StreamChunk

REUSE_KEY = "reuse_report"
"""Key of the :class:`~craft_rag.engine.results.ReuseReport` in ``additional_kwargs``."""

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct (embedded)"

_SAMPLING_KWARGS = ("max_tokens", "temperature", "top_p", "seed", "stop", "read_prefix_cache")


def _response_kwargs(result: GenerationResult) -> dict[str, Any]:
    return {REUSE_KEY: result.report, "finish_reason": result.finish_reason}


def _message_text(message: ChatMessage, index: int) -> str:
    parts: list[str] = []
    for block in message.blocks:
        if not isinstance(block, TextBlock):
            msg = (
                f"messages[{index}] holds a {type(block).__name__}; CraftVLLM serves text-only "
                "models, so send text blocks only"
            )
            raise ValueError(msg)
        parts.append(block.text)
    return "".join(parts)


class CraftVLLM(LLM):
    """LlamaIndex LLM over one :class:`craft_rag.engine.engine.CraftEngine`.

    Pass a running ``engine`` (shared, not closed by this object), or ``engine_settings`` (or
    nothing, for the embedded default model) to start one that :meth:`close` stops.

    On construction the engine's planner is wrapped in a
    :class:`~llama_index.llms.craft_vllm.planner.HandoffPlanner` (``planner=`` replaces the
    engine's planner first; either way the engine forgets its conversation histories), so plans
    made by :meth:`reorderer` postprocessors are served as planned and committed with the
    engine's truth. Thread-safe as far as the engine is (one driver thread serialises vLLM).
    """

    model: str = Field(default=EMBEDDED_MODEL_NAME, description="Model name for LLMMetadata.")
    max_tokens: int = Field(default=64, gt=0, description="Default max new tokens per request.")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling p.")
    seed: int | None = Field(default=None, description="Per-request sampling seed.")
    read_prefix_cache: bool = Field(
        default=True,
        description="False: compute every prompt in full (the no-cache baseline on one engine).",
    )

    _engine: CraftEngine = PrivateAttr()
    _owns_engine: bool = PrivateAttr(default=False)
    _planner: HandoffPlanner = PrivateAttr()
    _raw: RawPromptRunner = PrivateAttr()
    _chat_renderer: ChatRenderer | None = PrivateAttr(default=None)

    def __init__(
        self,
        engine: CraftEngine | None = None,
        *,
        engine_settings: EngineSettings | None = None,
        planner: CraftPlanner | None = None,
        **data: Any,
    ) -> None:
        if engine is not None and engine_settings is not None:
            msg = "pass either engine= (a running CraftEngine) or engine_settings=, not both"
            raise ValueError(msg)
        if engine is not None and not isinstance(engine, CraftEngine):
            msg = f"engine must be a craft_rag CraftEngine, got {type(engine).__name__}"
            raise ValueError(msg)
        owns = engine is None
        if engine is None:
            engine = CraftEngine(engine_settings or EngineSettings())
        if "model" not in data and engine.settings.model is not None:
            data["model"] = str(engine.settings.model)
        super().__init__(**data)
        self._engine = engine
        self._owns_engine = owns
        current = engine.planner
        if planner is not None:
            adapter = HandoffPlanner(planner)
            engine.set_planner(adapter)
        elif isinstance(current, HandoffPlanner):
            adapter = current  # another CraftVLLM on this engine installed it: share it
        elif isinstance(current, CraftPlanner):
            adapter = HandoffPlanner(current)
            engine.set_planner(adapter)
        else:
            msg = (
                f"the engine's planner is a {type(current).__name__}; CraftVLLM needs a "
                "craft_rag.CraftPlanner: pass planner=CraftPlanner(...)"
            )
            raise ValueError(msg)
        self._planner = adapter
        self._raw = RawPromptRunner(engine)

    @classmethod
    def class_name(cls) -> str:
        return "CraftVLLM"

    # ---- handles ----

    @property
    def engine(self) -> CraftEngine:
        return self._engine

    @property
    def planner(self) -> CraftPlanner:
        """The CRAFT planner the engine serves with (shared with :meth:`reorderer`)."""
        return self._planner.planner

    @property
    def handoff_planner(self) -> HandoffPlanner:
        return self._planner

    def reorderer(self, **settings: Any) -> CraftReorderPostprocessor:
        """A :class:`CraftReorderPostprocessor` wired to this engine: shared planner,
        ``commit_mode="engine"``, plans parked where the engine claims them. ``settings`` are
        its other fields (``key_source``, ``conversation_id``)."""
        for name in ("planner", "commit_mode", "handoff"):
            if name in settings:
                msg = (
                    f"{name} is set by CraftVLLM.reorderer(); pass only key_source/conversation_id"
                )
                raise ValueError(msg)
        return CraftReorderPostprocessor(
            planner=self.planner,
            handoff=self._planner.handoff,
            commit_mode="engine",
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

    # ---- prompt rendering ----

    def _sampling(self, kwargs: dict[str, Any]) -> SamplingRequest:
        unknown = set(kwargs) - set(_SAMPLING_KWARGS) - {"formatted"}
        if unknown:
            msg = f"unknown keyword arguments {sorted(unknown)}; CraftVLLM takes {_SAMPLING_KWARGS}"
            raise ValueError(msg)
        stop = kwargs.get("stop") or ()
        return SamplingRequest(
            max_tokens=int(kwargs.get("max_tokens") or self.max_tokens),
            temperature=float(kwargs.get("temperature", self.temperature)),
            top_p=float(kwargs.get("top_p", self.top_p)),
            seed=kwargs.get("seed", self.seed),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            read_prefix_cache=bool(kwargs.get("read_prefix_cache", self.read_prefix_cache)),
        )

    def _renderer(self) -> ChatRenderer:
        if self._chat_renderer is None:
            self._chat_renderer = ChatRenderer(resolve_model(self._engine.settings.model))
        return self._chat_renderer

    def _chat_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        if not messages:
            msg = "chat() needs at least one message"
            raise ValueError(msg)
        rendered = []
        if self.system_prompt and messages[0].role != MessageRole.SYSTEM:
            rendered.append({"role": "system", "content": self.system_prompt})
        for i, m in enumerate(messages):
            rendered.append({"role": m.role.value, "content": _message_text(m, i)})
        text = self._renderer()(rendered, True)
        return self._engine.assembler.tokenizer.encode(text)

    def _completion_ids(self, prompt: str, formatted: bool) -> list[int]:
        if not isinstance(prompt, str) or not prompt:
            msg = "prompt must be a non-empty string"
            raise ValueError(msg)
        if formatted:
            return self._engine.assembler.tokenizer.encode(prompt)
        to_prompt = self.completion_to_prompt
        if to_prompt is not None and to_prompt is not _identity_completion_to_prompt:
            return self._engine.assembler.tokenizer.encode(to_prompt(prompt))
        # An instruct model: a bare prompt is one user message in its chat template.
        return self._chat_ids([ChatMessage(role=MessageRole.USER, content=prompt)])

    # ---- response building ----

    @staticmethod
    def _completion(result: GenerationResult) -> CompletionResponse:
        return CompletionResponse(
            text=result.text, raw=result, additional_kwargs=_response_kwargs(result)
        )

    @staticmethod
    def _chat(result: GenerationResult) -> ChatResponse:
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, content=result.text),
            raw=result,
            additional_kwargs=_response_kwargs(result),
        )

    @staticmethod
    def _completion_stream(pieces: Iterator[StreamChunk]) -> CompletionResponseGen:
        text = ""
        for piece in pieces:
            text += piece.text
            if piece.result is None:
                yield CompletionResponse(text=text, delta=piece.text)
            else:
                yield CompletionResponse(
                    text=text,
                    delta="",
                    raw=piece.result,
                    additional_kwargs=_response_kwargs(piece.result),
                )

    @staticmethod
    async def _acompletion_stream(pieces: AsyncIterator[StreamChunk]) -> CompletionResponseAsyncGen:
        text = ""
        async for piece in pieces:
            text += piece.text
            if piece.result is None:
                yield CompletionResponse(text=text, delta=piece.text)
            else:
                yield CompletionResponse(
                    text=text,
                    delta="",
                    raw=piece.result,
                    additional_kwargs=_response_kwargs(piece.result),
                )

    @staticmethod
    def _chat_stream(pieces: Iterator[StreamChunk]) -> ChatResponseGen:
        text = ""
        for piece in pieces:
            text += piece.text
            message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
            if piece.result is None:
                yield ChatResponse(message=message, delta=piece.text)
            else:
                yield ChatResponse(
                    message=message,
                    delta="",
                    raw=piece.result,
                    additional_kwargs=_response_kwargs(piece.result),
                )

    @staticmethod
    async def _achat_stream(pieces: AsyncIterator[StreamChunk]) -> ChatResponseAsyncGen:
        text = ""
        async for piece in pieces:
            text += piece.text
            message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
            if piece.result is None:
                yield ChatResponse(message=message, delta=piece.text)
            else:
                yield ChatResponse(
                    message=message,
                    delta="",
                    raw=piece.result,
                    additional_kwargs=_response_kwargs(piece.result),
                )

    @staticmethod
    async def _collect(pieces: AsyncIterator[StreamChunk]) -> GenerationResult:
        async for piece in pieces:
            if piece.result is not None:
                return piece.result
        msg = "the engine stream ended without a result"
        raise RuntimeError(msg)

    # ---- LlamaIndex LLM interface: free-form prompts ----

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        sampling = self._sampling(kwargs)
        return self._completion(
            self._raw.generate(self._completion_ids(prompt, formatted), sampling)
        )

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        sampling = self._sampling(kwargs)
        ids = self._completion_ids(prompt, formatted)
        return self._completion_stream(self._raw.stream(ids, sampling))

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        sampling = self._sampling(kwargs)
        return self._chat(self._raw.generate(self._chat_ids(messages), sampling))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        sampling = self._sampling(kwargs)
        return self._chat_stream(self._raw.stream(self._chat_ids(messages), sampling))

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        sampling = self._sampling(kwargs)
        ids = self._completion_ids(prompt, formatted)
        return self._completion(await self._collect(self._raw.astream(ids, sampling)))

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        sampling = self._sampling(kwargs)
        ids = self._completion_ids(prompt, formatted)
        return self._acompletion_stream(self._raw.astream(ids, sampling))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        sampling = self._sampling(kwargs)
        ids = self._chat_ids(messages)
        return self._chat(await self._collect(self._raw.astream(ids, sampling)))

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        sampling = self._sampling(kwargs)
        return self._achat_stream(self._raw.astream(self._chat_ids(messages), sampling))

    # ---- the chunk interface: RAG through CRAFT ----

    def complete_chunks(
        self,
        chunks: Sequence[Chunk],
        question: str,
        *,
        conversation_id: str | None = None,
        **kwargs: Any,
    ) -> CompletionResponse:
        """Answer ``question`` over ``chunks`` as one token-exact CRAFT prompt (a parked plan
        for exactly these chunks is served as planned; otherwise the engine plans). Blocks.
        ``ValueError`` for an empty question or a prompt that cannot fit."""
        result = self._engine.generate(
            chunks, question, conversation_id=conversation_id, sampling=self._sampling(kwargs)
        )
        return self._completion(result)

    def stream_complete_chunks(
        self,
        chunks: Sequence[Chunk],
        question: str,
        *,
        conversation_id: str | None = None,
        **kwargs: Any,
    ) -> CompletionResponseGen:
        """Streaming :meth:`complete_chunks`. The request starts when the generator is first
        advanced; closing it early aborts the request (nothing committed)."""
        sampling = self._sampling(kwargs)
        return self._completion_stream(
            self._engine.stream(
                chunks, question, conversation_id=conversation_id, sampling=sampling
            )
        )

    async def acomplete_chunks(
        self,
        chunks: Sequence[Chunk],
        question: str,
        *,
        conversation_id: str | None = None,
        **kwargs: Any,
    ) -> CompletionResponse:
        """Async :meth:`complete_chunks` (the event loop never blocks on the engine)."""
        sampling = self._sampling(kwargs)
        pieces = self._engine.astream(
            chunks, question, conversation_id=conversation_id, sampling=sampling
        )
        return self._completion(await self._collect(pieces))

    def astream_complete_chunks(
        self,
        chunks: Sequence[Chunk],
        question: str,
        *,
        conversation_id: str | None = None,
        **kwargs: Any,
    ) -> CompletionResponseAsyncGen:
        """Async streaming :meth:`complete_chunks`."""
        sampling = self._sampling(kwargs)
        return self._acompletion_stream(
            self._engine.astream(
                chunks, question, conversation_id=conversation_id, sampling=sampling
            )
        )
