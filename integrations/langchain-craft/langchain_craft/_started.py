"""The prompt before generation: a request submitted before LangChain's run starts, handed to
the same call's ``_stream`` through a context variable.

Each model's ``invoke``/``stream`` (and async forms) builds and submits the request *before*
LangChain's run starts (``CraftEngineParams._start_call``), so the run's metadata,
``on_chat_model_start``/``on_llm_start`` and tracers carry the exact prompt
(``metadata["craft_prompt"]``). LangChain then calls the model's ``_stream``, which takes that
very request (:func:`take_started`) instead of submitting its own. The wrappers here
(:func:`run_started`, :func:`stream_started` and their async forms) make the request visible
to ``_stream`` for exactly LangChain's call and abort it afterwards unless it finished: a
request LangChain never asked for (an LLM-cache hit, a failing callback) commits nothing.

Invariant: :data:`_STARTED` is set and reset within one step of the caller (never across a
``yield``), so a nested call, of this model or another, sees its own request and the outer
call sees its own again afterwards.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from craft_rag.engine import RequestHandle

T = TypeVar("T")

Call = tuple[Any, ...]
"""What one LangChain call hands ``_stream``: ``(input, stop, kwargs)``, input being the chat
model's messages or the LLM's prompt string."""


@dataclass(slots=True)
class StartedRequest:
    """A request submitted by one ``invoke``/``stream`` call before LangChain's run starts, so
    the run's start callbacks carry its prompt; or the error submitting it raised, which the
    run raises (never submitted twice). Owner: that call, which aborts the request once
    LangChain returns (a no-op once it finished). ``taken`` is set once, by the first
    ``_stream`` of the same model for the same ``call`` (:func:`take_started`), which then
    serves it or raises its error."""

    model: object  # compared by identity: only this model's _stream takes the request
    call: Call
    handle: RequestHandle | None  # None: submitting raised ``error``
    error: Exception | None = None
    taken: bool = False

    def abort(self) -> None:
        """Stop the request unless it ended (nothing committed); idempotent."""
        if self.handle is not None:
            self.handle.abort()


_STARTED: ContextVar[StartedRequest | None] = ContextVar("langchain_craft_started", default=None)
"""The request of the innermost pre-starting call in this context. Why a context variable:
LangChain hands ``_stream`` only the input and the call's kwargs (which also reach its cache
key and invocation params), so nothing per call can ride along; a context variable is per
thread and per task, set and reset around LangChain's call within one step (never across a
yield), so a nested call, of this model or another, sees its own request and the outer one
sees its own again afterwards."""

_NOTHING: Any = object()
"""End-of-stream marker for the first ``next``."""


def take_started(model: object, call: Call) -> RequestHandle | None:
    """The request ``model``'s ``invoke``/``stream`` started for ``call``, once (raising the
    error submitting it raised); ``None`` for another model, another call, or a request
    already taken (the caller submits its own). O(size of the call)."""
    started = _STARTED.get()
    if started is None or started.model is not model or started.taken:
        return None
    if started.call != call:
        return None
    started.taken = True
    if started.error is not None:
        raise started.error
    return started.handle


def run_started(started: StartedRequest | None, run: Callable[[], T]) -> T:
    """``run()`` (LangChain's ``invoke``) with ``started`` visible to ``_stream``; then the
    request is aborted unless it finished (untaken: an LLM-cache hit, a callback's error),
    so nothing is committed for it."""
    if started is None:
        return run()
    token = _STARTED.set(started)
    try:
        return run()
    finally:
        _STARTED.reset(token)
        started.abort()


async def arun_started(started: StartedRequest | None, run: Callable[[], Awaitable[T]]) -> T:
    """Async :func:`run_started`."""
    if started is None:
        return await run()
    token = _STARTED.set(started)
    try:
        return await run()
    finally:
        _STARTED.reset(token)
        started.abort()


def stream_started(started: StartedRequest | None, chunks: Iterator[T]) -> Iterator[T]:
    """LangChain's ``stream`` (``chunks``) with ``started`` visible until its first chunk,
    by which LangChain has called ``_stream``: set and reset within one step of this
    generator, never across a yield. Closing early closes ``chunks`` (LangChain reports
    the run's end) and aborts the request."""
    if started is None:
        yield from chunks
        return
    try:
        token = _STARTED.set(started)
        try:
            first = next(chunks, _NOTHING)
        finally:
            _STARTED.reset(token)
        if not started.taken:  # LangChain served nothing (or another request): stop it now
            started.abort()
        if first is not _NOTHING:
            yield first
            yield from chunks
    finally:
        close = getattr(chunks, "close", None)
        if callable(close):
            close()
        started.abort()


async def astream_started(
    started: StartedRequest | None, chunks: AsyncIterator[T]
) -> AsyncIterator[T]:
    """Async :func:`stream_started` (set and reset within one ``__anext__`` of this
    generator, so within one task's context)."""
    if started is None:
        async for chunk in chunks:
            yield chunk
        return
    try:
        token = _STARTED.set(started)
        try:
            first = await anext(chunks, _NOTHING)
        finally:
            _STARTED.reset(token)
        if not started.taken:
            started.abort()
        if first is not _NOTHING:
            yield first
            async for chunk in chunks:
                yield chunk
    finally:
        aclose = getattr(chunks, "aclose", None)
        if callable(aclose):
            await aclose()
        started.abort()
