"""``CraftVLLM``: a LangChain completion LLM served by craft-rag's vLLM engine (in-process, or a
vLLM server).

A prompt string is the question; ``documents=`` (and ``conversation_id=``) on the call make it a
RAG request that the engine plans, serves token-exactly and commits, as for ``ChatCraftVLLM``.
(A completion LLM sees prompts as plain strings, so ``CraftRAGPrompt``'s structured context
cannot reach it; use ``ChatCraftVLLM`` in LCEL RAG chains.) Each request streams from the engine:
``on_llm_new_token`` fires per token, and ``generation_info["craft"]`` is the reuse report
(``llm_output["craft"]`` lists every prompt's report; ``invoke`` returns only the text, so use
``generate``/``stream``'s last chunk or a callback to read it).

The exact prompt (``{"text", "token_ids"}``) is known before generation: ``invoke``, ``stream``,
``ainvoke`` and ``astream`` submit the request first and put it in the run's metadata under
``craft_prompt``, so ``on_llm_start(..., metadata=...)`` and tracers record it;
``generation_info["craft_prompt"]`` repeats it. ``batch``/``generate`` (one LangChain run over
several prompts) show it in ``generation_info`` only. An LLM-cache hit aborts the started
request: nothing is committed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM, LangSmithParams, LanguageModelInput
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from langchain_core.runnables import RunnableConfig

from craft_rag import check_text
from langchain_craft._documents import validate_conversation_id
from langchain_craft._engine import CraftEngineParams, EngineRequest
from langchain_craft._results import final_metadata, usage_metadata
from langchain_craft._started import (
    Call,
    arun_started,
    astream_started,
    run_started,
    stream_started,
)
from langchain_craft.prompt import build_context


class CraftVLLM(CraftEngineParams, BaseLLM):
    """Completion LLM over a ``CraftEngine`` (vLLM with prefix caching and CRAFT).

    ``llm.invoke("Who wrote Hamlet?", documents=docs, conversation_id="s1")``; the final
    generation's ``generation_info`` holds ``craft`` (the reuse report), ``usage`` and
    ``finish_reason``. Same per-call arguments as ``ChatCraftVLLM``.
    """

    streaming: bool = False
    """Accepted for compatibility; every call streams from the engine anyway."""

    @property
    def _llm_type(self) -> str:
        return "craft-vllm"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._craft_ls_params(  # type: ignore[no-any-return]
            super()._get_ls_params(stop=stop, **kwargs), kwargs
        )

    # ---- the prompt before generation: LangChain's entry points, request started first ----------

    def invoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> str:
        """LangChain's ``invoke``, the request submitted first: ``on_llm_start`` and the run's
        metadata carry its prompt under ``craft_prompt`` (module docstring)."""
        started, config = self._start_call(partial(self._prepared, input, stop, kwargs), config)
        run = partial(super().invoke, input, config, stop=stop, **kwargs)
        return run_started(started, run)

    async def ainvoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> str:
        """Async :meth:`invoke`."""
        started, config = self._start_call(partial(self._prepared, input, stop, kwargs), config)
        run = partial(super().ainvoke, input, config, stop=stop, **kwargs)
        return await arun_started(started, run)

    def stream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> Iterator[str]:
        """LangChain's ``stream``, the request submitted first (see :meth:`invoke`)."""
        started, config = self._start_call(partial(self._prepared, input, stop, kwargs), config)
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
    ) -> AsyncIterator[str]:
        """Async :meth:`stream`."""
        started, config = self._start_call(partial(self._prepared, input, stop, kwargs), config)
        async for chunk in astream_started(
            started, super().astream(input, config, stop=stop, **kwargs)
        ):
            yield chunk

    def _prepared(
        self, input: LanguageModelInput, stop: list[str] | None, kwargs: dict[str, Any]
    ) -> tuple[Call, Callable[[], EngineRequest]]:
        """The call as LangChain hands it to ``_stream`` (the prompt as a string) and its
        request's builder."""
        prompt = self._convert_input(input).to_string()
        return (prompt, stop, kwargs), partial(self._request, prompt, stop, kwargs)

    def _request(
        self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]
    ) -> EngineRequest:
        if not isinstance(prompt, str) or not prompt.strip():
            msg = f"prompt must be a non-empty string, got {prompt!r}"
            raise ValueError(msg)
        check_text(prompt, "prompt")
        conversation_id = validate_conversation_id(kwargs.get("conversation_id"))
        documents = kwargs.get("documents")
        chunks: tuple[Any, ...] = ()
        if documents is not None:
            context = build_context(documents, prompt, conversation_id=conversation_id)
            chunks = context.chunks
        return self._engine_request(chunks, prompt, conversation_id, stop, kwargs)

    def _to_chunk(self, piece: Any) -> GenerationChunk:
        if piece.result is None:
            return GenerationChunk(text=piece.text)
        prompt = self.sent_prompt(piece.result)
        info = final_metadata(piece.result, self.served_model_name(), prompt)
        info["usage"] = dict(usage_metadata(piece.result))
        return GenerationChunk(text=piece.text, generation_info=info)

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        call, build = (prompt, stop, kwargs), partial(self._request, prompt, stop, kwargs)
        yield from self._engine_stream(call, build, self._to_chunk, run_manager)

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        call, build = (prompt, stop, kwargs), partial(self._request, prompt, stop, kwargs)
        async for chunk in self._engine_astream(call, build, self._to_chunk, run_manager):
            yield chunk

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        generations = [
            [_merge(list(self._stream(p, stop, run_manager, **kwargs)))] for p in prompts
        ]
        return _result(generations)

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        generations = []
        for p in prompts:
            chunks = [c async for c in self._astream(p, stop, run_manager, **kwargs)]
            generations.append([_merge(chunks)])
        return _result(generations)


def _merge(chunks: list[GenerationChunk]) -> Generation:
    assert chunks and chunks[-1].generation_info, "engine stream ended early"
    text = "".join(c.text for c in chunks)
    return Generation(text=text, generation_info=chunks[-1].generation_info)


def _result(generations: list[list[Generation]]) -> LLMResult:
    usage = [g[0].generation_info["usage"] for g in generations if g[0].generation_info]
    token_usage = {
        "prompt_tokens": sum(u["input_tokens"] for u in usage),
        "completion_tokens": sum(u["output_tokens"] for u in usage),
        "cached_tokens": sum(u["input_token_details"]["cache_read"] for u in usage),
    }
    reports = [g[0].generation_info.get("craft") for g in generations if g[0].generation_info]
    return LLMResult(
        generations=generations, llm_output={"token_usage": token_usage, "craft": reports}
    )
