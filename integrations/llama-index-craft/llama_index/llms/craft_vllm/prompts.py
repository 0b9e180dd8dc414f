"""Free-form prompts (``complete``/``chat`` without chunks) on a ``CraftEngine``.

``CraftEngine`` serves RAG requests (chunks + question) only. A LlamaIndex LLM must also answer
plain prompts and chat message lists, so this module renders them (the model's own chat
template) and submits the token ids through the engine's driver thread, the same path and the
same streaming the engine uses for RAG requests. vLLM's prefix cache still applies (a chat
re-sent with one more message reuses the earlier messages' KV); nothing is planned or committed.

This reaches into ``CraftEngine._driver`` (no public raw-prompt method exists yet); it is the
only place that does, and it fails with a clear ``RuntimeError`` if that ever changes. It should
become ``CraftEngine.generate_tokens``/``stream_tokens``/``astream_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import queue
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from craft_rag.engine.chat_format import jinja_renderer, load_chat_template
from craft_rag.engine.driver import RequestState
from craft_rag.engine.engine import CraftEngine
from craft_rag.engine.results import (
    GenerationResult,
    ReuseReport,
    SamplingRequest,
    StepOutput,
    StreamChunk,
)

Message = Mapping[str, str]


def _special_tokens(model_dir: Path) -> dict[str, str]:
    """``bos_token``/``eos_token``... from ``tokenizer_config.json``, for templates using them."""
    config = model_dir / "tokenizer_config.json"
    if not config.is_file():
        return {}
    data = json.loads(config.read_text(encoding="utf-8"))
    out: dict[str, str] = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = data.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


class ChatRenderer:
    """Renders chat messages with a model folder's chat template (jinja, as transformers does).
    Cost: one template compile at construction; microseconds per render."""

    def __init__(self, model_dir: str | Path) -> None:
        folder = Path(model_dir)
        self._render = jinja_renderer(load_chat_template(folder), _special_tokens(folder))

    def __call__(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        return self._render(messages, add_generation_prompt)


class RawPromptRunner:
    """Generates from raw token ids on ``engine``: blocking, streaming and async streaming.

    Each result carries a :class:`ReuseReport` with no chunks (``chunk_order=()``): prompt and
    cached tokens, TTFT and latency. Closing a stream early aborts the request.
    """

    def __init__(self, engine: CraftEngine) -> None:
        self._engine = engine

    def _driver(self) -> Any:
        driver = getattr(self._engine, "_driver", None)
        if driver is None or not hasattr(driver, "submit"):
            msg = (
                "this CraftEngine has no driver to submit raw prompts to; llama-index-craft "
                "needs a craft-rag version whose engine steps requests on a driver thread"
            )
            raise RuntimeError(msg)
        return driver

    def check_fits(self, token_ids: Sequence[int], sampling: SamplingRequest) -> None:
        limit = self._engine.max_model_len
        if len(token_ids) + sampling.max_tokens > limit:
            msg = (
                f"prompt of {len(token_ids)} tokens plus max_tokens={sampling.max_tokens} "
                f"exceeds the engine's max_model_len={limit}; shorten the prompt or lower "
                "max_tokens"
            )
            raise ValueError(msg)
        if not token_ids:
            msg = "the prompt rendered to zero tokens; pass a non-empty prompt"
            raise ValueError(msg)

    def _submit(
        self,
        token_ids: Sequence[int],
        sampling: SamplingRequest,
        on_delta: Callable[[StepOutput, float], object] | None = None,
        on_done: Callable[[], object] | None = None,
    ) -> RequestState:
        self.check_fits(token_ids, sampling)
        state = RequestState(f"craft-li-{uuid.uuid4().hex}", on_delta=on_delta, on_done=on_done)
        self._driver().submit(list(token_ids), sampling, state)
        return state

    def _result(self, state: RequestState, prompt_tokens: int, sampling: SamplingRequest) -> Any:
        if state.error is not None:
            raise state.error
        first = state.first_token_at if state.first_token_at is not None else state.finished_at
        end = state.finished_at if state.finished_at is not None else state.submitted_at
        report = ReuseReport(
            request_id=state.request_id,
            prompt_tokens=prompt_tokens,
            cached_tokens=state.num_cached_tokens or 0,
            predicted_tokens=None,
            predicted_chunks=0,
            reused_chunks=0,
            prefix_tokens=0,
            ttft_ms=((first or state.submitted_at) - state.submitted_at) * 1000.0,
            latency_ms=(end - state.submitted_at) * 1000.0,
            output_tokens=len(state.token_ids),
            chunk_order=(),
            removed_duplicates=(),
            repeated_in_request=(),
            dropped_turns=0,
            conversation_id=None,
            turn=1,
            read_prefix_cache=sampling.read_prefix_cache,
        )
        return GenerationResult(
            text=state.text,
            token_ids=tuple(state.token_ids),
            finish_reason=state.finish_reason,
            report=report,
        )

    def _abort(self, state: RequestState) -> None:
        self._driver().abort(state.request_id)

    def generate(self, token_ids: Sequence[int], sampling: SamplingRequest) -> GenerationResult:
        """Run to completion. Raises the engine's error (``EngineFailure``) if it fails."""
        state = self._submit(token_ids, sampling)
        try:
            state.done.wait()
        except BaseException:
            self._abort(state)
            raise
        result: GenerationResult = self._result(state, len(token_ids), sampling)
        return result

    def stream(self, token_ids: Sequence[int], sampling: SamplingRequest) -> Iterator[StreamChunk]:
        """Yield deltas as the driver produces them; the last chunk carries the result."""
        inbox: queue.SimpleQueue[tuple[StepOutput, float] | None] = queue.SimpleQueue()
        state = self._submit(
            token_ids, sampling, lambda out, now: inbox.put((out, now)), lambda: inbox.put(None)
        )
        finished = False
        try:
            while (item := inbox.get()) is not None:
                piece = _piece(state, *item)
                if piece is not None:
                    yield piece
            finished = True
            result = self._result(state, len(token_ids), sampling)
            yield StreamChunk(
                text="", token_ids=(), elapsed_ms=result.report.latency_ms, result=result
            )
        finally:
            if not finished:
                self._abort(state)

    async def astream(
        self, token_ids: Sequence[int], sampling: SamplingRequest
    ) -> AsyncIterator[StreamChunk]:
        """Async :meth:`stream`: deltas cross from the driver thread through an asyncio queue,
        so the event loop never waits on a forward pass."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[StepOutput, float] | None] = asyncio.Queue()
        state = self._submit(
            token_ids,
            sampling,
            lambda out, now: loop.call_soon_threadsafe(inbox.put_nowait, (out, now)),
            lambda: loop.call_soon_threadsafe(inbox.put_nowait, None),
        )
        finished = False
        try:
            while (item := await inbox.get()) is not None:
                piece = _piece(state, *item)
                if piece is not None:
                    yield piece
            finished = True
            result = self._result(state, len(token_ids), sampling)
            yield StreamChunk(
                text="", token_ids=(), elapsed_ms=result.report.latency_ms, result=result
            )
        finally:
            if not finished:
                self._abort(state)


def _piece(state: RequestState, out: StepOutput, now: float) -> StreamChunk | None:
    if not out.new_token_ids and not out.new_text:
        return None
    return StreamChunk(
        text=out.new_text,
        token_ids=out.new_token_ids,
        elapsed_ms=(now - state.submitted_at) * 1000.0,
    )
