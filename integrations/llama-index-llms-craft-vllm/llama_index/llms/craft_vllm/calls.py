"""One engine request, served blocking, streaming or async: the only loops of ``CraftVLLM``.

``CraftVLLM`` has twelve entry points (``complete``, ``chat``, ``complete_chunks`` times
blocking, streaming, async and async streaming). They differ in two things only: which engine
request they make (an :class:`EngineCall`: one of the engine's request kinds, submitted with
``engine.submit`` when the response is read) and which LlamaIndex response they return (a
:data:`MakeResponse`). :func:`respond`, :func:`respond_stream`, :func:`arespond` and
:func:`arespond_stream` combine the two, reading the engine's ``RequestHandle`` one way each;
the per-piece work of both stream forms is one function (:class:`_Deltas`), so the sync and
async paths cannot drift apart.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Generator, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    CompletionResponse,
    MessageRole,
)
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.llms.craft_vllm.reuse import ReuseCollector, open_collectors
from llama_index.postprocessor.craft import CraftCommitEvent
from llama_index_instrumentation import get_dispatcher

from craft_rag import Plan
from craft_rag.engine import (
    CraftEngine,
    EngineRequest,
    GenerationResult,
    RequestHandle,
    StreamChunk,
)

dispatcher = get_dispatcher(__name__)

REUSE_KEY = "craft_reuse"
"""The one key of the :class:`~craft_rag.engine.results.ReuseReport` in this package: LLM
responses' ``additional_kwargs``, query and chat responses' ``metadata``."""
LEGACY_REUSE_KEY = "reuse_report"
"""Deprecated alias of :data:`REUSE_KEY` (still written; removed in the next release)."""
PROMPT_KEY = "craft_prompt"
"""``additional_kwargs`` key of the exact prompt sent: ``{"text", "token_ids"}`` (``text``:
the ids decoded with control tokens spelled out; ``None`` when the tokenizer cannot decode)."""

R = TypeVar("R", CompletionResponse, ChatResponse)


@dataclass(frozen=True, slots=True)
class Served:
    """A finished request: the engine's result and the prompt it sent (:data:`PROMPT_KEY`)."""

    result: GenerationResult
    prompt: dict[str, Any]


MakeResponse = Callable[[str, str | None, Served | None], R]
"""``(text so far, delta, served)`` -> a LlamaIndex response; ``served`` only on the last."""


class CraftPromptEvent(BaseEvent):
    """The exact prompt of one ``CraftVLLM`` request, on the instrumentation dispatcher as
    soon as it is rendered and started, before its first token (inside the call's span, after
    LlamaIndex's ``LLMCompletionStartEvent``/``LLMChatStartEvent``, which fire before the
    prompt exists). The response carries it too under ``additional_kwargs["craft_prompt"]``."""

    text: str | None
    token_ids: list[int]
    request_id: str

    @classmethod
    def class_name(cls) -> str:
        return "CraftPromptEvent"


def sent_prompt(engine: CraftEngine, result: GenerationResult) -> dict[str, Any]:
    """``{"text", "token_ids"}`` of what ``result``'s request sent. O(prompt tokens)."""
    ids = list(result.prompt_token_ids)
    decode = getattr(engine.tokenizer, "decode", None)
    return {"text": decode(ids) if callable(decode) else None, "token_ids": ids}


@dataclass(frozen=True, slots=True)
class EngineCall:
    """One engine request, submitted when a response is read (exactly once).

    ``plan`` is the caller-made plan the request serves (``None`` for prompts without chunks);
    once the engine returns, :meth:`served` reports its commit.
    """

    engine: CraftEngine
    request: EngineRequest
    plan: Plan | None = None
    collectors: tuple[ReuseCollector, ...] = ()
    """Reuse collectors open when the call was made (a synthesis in progress): each gets the
    report, also when a stream finishes after the synthesis returned."""
    give_up: Callable[[], object] | None = None
    """Aborts ``plan`` when the request fails or is closed before it finished (a committed
    plan is left alone): set when the call itself found or made the plan, whose conversation
    would otherwise keep a plan in flight (the engine hands a ``plan=`` back to its holder)."""

    @classmethod
    def of(
        cls,
        engine: CraftEngine,
        request: EngineRequest,
        plan: Plan | None = None,
        give_up: Callable[[], object] | None = None,
    ) -> EngineCall:
        """The call of ``request`` on ``engine``, with the reuse collectors open now."""
        return cls(engine, request, plan, open_collectors(), give_up)

    @contextmanager
    def giving_up_on_failure(self) -> Iterator[None]:
        """Run :attr:`give_up` if the body raises (errors, cancellation, a stream closed
        early), then re-raise."""
        try:
            yield
        except BaseException:
            if self.give_up is not None:
                self.give_up()
            raise

    def submit(self) -> RequestHandle:
        """Start the request (``engine.submit``: planned, rendered, started) and emit its
        :class:`CraftPromptEvent`. Cost: one decode of the prompt ids."""
        handle = self.engine.submit(self.request)
        ids = list(handle.prompt_token_ids)
        decode = getattr(self.engine.tokenizer, "decode", None)
        dispatcher.event(
            CraftPromptEvent(
                text=decode(ids) if callable(decode) else None,
                token_ids=ids,
                request_id=handle.request_id,
            )
        )
        return handle

    def served(self, result: GenerationResult) -> Served:
        """Emit ``CraftCommitEvent(source="engine")`` for the plan the engine just committed
        (it commits a served plan exactly when the request finished), and hand the report
        to the open reuse collectors."""
        for collector in self.collectors:
            collector.add(result.report)
        if self.plan is not None:
            assert result.report.plan_id == self.plan.plan_id, "the engine served another plan"
            dispatcher.event(CraftCommitEvent(plan=self.plan, source="engine", reuse=result.report))
        return Served(result, sent_prompt(self.engine, result))


def response_kwargs(served: Served) -> dict[str, Any]:
    report = served.result.report
    return {
        REUSE_KEY: report,
        LEGACY_REUSE_KEY: report,
        PROMPT_KEY: served.prompt,
        "finish_reason": served.result.finish_reason,
    }


def completion_response(
    text: str, delta: str | None, served: Served | None
) -> CompletionResponse:
    if served is None:
        return CompletionResponse(text=text, delta=delta)
    return CompletionResponse(
        text=text, delta=delta, raw=served.result, additional_kwargs=response_kwargs(served)
    )


def chat_response(text: str, delta: str | None, served: Served | None) -> ChatResponse:
    message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
    if served is None:
        return ChatResponse(message=message, delta=delta)
    return ChatResponse(
        message=message, delta=delta, raw=served.result, additional_kwargs=response_kwargs(served)
    )


class _Deltas:
    """Stream pieces -> cumulative responses; the last one (empty delta) carries the result.
    The one per-piece step of :func:`respond_stream` and :func:`arespond_stream`."""

    def __init__(self, call: EngineCall, make: MakeResponse[R]) -> None:
        self._call = call
        self._make: MakeResponse[Any] = make
        self._text = ""

    def __call__(self, piece: StreamChunk) -> Any:
        self._text += piece.text
        if piece.result is None:
            return self._make(self._text, piece.text, None)
        return self._make(self._text, "", self._call.served(piece.result))


def respond(call: EngineCall, make: MakeResponse[R]) -> R:
    """Run ``call`` to completion (blocks); one response with the result."""
    with call.giving_up_on_failure():
        served = call.served(call.submit().result())
    return make(served.result.text, None, served)


def respond_stream(call: EngineCall, make: MakeResponse[R]) -> Generator[R, None, None]:
    """Yield a response per delta as the engine's driver thread produces it. The request starts
    when the iterator is first advanced; closing it early aborts it (nothing committed)."""
    step = _Deltas(call, make)
    with call.giving_up_on_failure():
        for piece in call.submit():
            yield step(piece)


async def arespond_stream(call: EngineCall, make: MakeResponse[R]) -> AsyncGenerator[R, None]:
    """Async :func:`respond_stream`: deltas cross threads through an asyncio queue, so the
    event loop never waits on a forward pass; cancelling the consumer aborts the request."""
    step = _Deltas(call, make)
    with call.giving_up_on_failure():
        async with aclosing(call.submit().__aiter__()) as pieces:
            async for piece in pieces:
                yield step(piece)


async def arespond(call: EngineCall, make: MakeResponse[R]) -> R:
    """Async :func:`respond` (``RequestHandle.aresult``: never blocks the event loop)."""
    with call.giving_up_on_failure():
        served = call.served(await call.submit().aresult())
    return make(served.result.text, None, served)
