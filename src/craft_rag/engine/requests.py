"""The request lifecycle: one submitted request, from start to commit or abort.

:meth:`CraftEngine.submit` starts a request (:data:`~craft_rag.engine.results.EngineRequest`)
and returns its :class:`RequestHandle`; every public ``generate``/``stream``/``astream`` form is
a one-line wrapper over it. The handle is fed by the driver thread (one
:class:`~craft_rag.engine.driver.RequestState` per request) and read in one of three ways:
:meth:`RequestHandle.result` waits on the state's event, iteration on a condition, async
iteration on an ``asyncio.Event`` set through the consumer's loop, so an event loop never waits
on a forward pass.

Invariant: a request ends exactly once, under the handle's lock: *finished* (the first
``result()`` or completed iteration commits its turn and builds the result, cached for later
reads) or *given up* (``abort()``, an iteration closed early, a waiter interrupted, a failure):
nothing is committed and the turn's state is restored (:class:`TurnHooks`).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from craft_rag.engine.driver import RequestCancelled, RequestState
from craft_rag.engine.results import (
    GenerationResult,
    RagRequest,
    ReuseReport,
    SamplingRequest,
    StepOutput,
    StreamChunk,
)
from craft_rag.types import CacheSalt

__all__ = [
    "InFlight",
    "RequestHandle",
    "TurnHooks",
    "astream_of",
    "chunk_reuse_fields",
    "finish_request",
    "plain_report",
    "result_of",
    "stream_of",
    "submit_batch",
]

OnDelta = Callable[[StepOutput, float], object]
OnDone = Callable[[], object]


class TurnHooks(Protocol):
    """The planner side of a RAG turn in flight (the RAG-turn module implements it). Exactly
    one of the two is called, once: ``commit`` when the request finished (commits the plan
    with what vLLM reused, records the turn, returns the result; on an exception the lifecycle
    calls ``give_up``), ``give_up`` when it will not be committed (restores the conversation,
    releases or aborts the plan)."""

    def commit(self, flight: InFlight) -> GenerationResult: ...

    def give_up(self) -> None: ...


@dataclass(slots=True)
class InFlight:
    """One started request. Owner: its :class:`RequestHandle`. ``turn`` is ``None`` for a
    prompt without chunks (nothing to commit)."""

    state: RequestState
    sampling: SamplingRequest
    token_ids: tuple[int, ...]
    cache_salt: CacheSalt | None = field(repr=False)  # a tenant's key: never shown
    turn: TurnHooks | None = None


Start = Callable[[OnDelta, OnDone], InFlight]
"""Starts the request with the handle's delta and done callbacks (raises: nothing started)."""


class RequestHandle:
    """A submitted request. ``result()`` blocks and returns the
    :class:`~craft_rag.engine.results.GenerationResult`; iterating (sync or ``async for``)
    yields :class:`~craft_rag.engine.results.StreamChunk` pieces as they are generated, the
    last one carrying the result; ``abort()`` stops it with nothing committed.

    Read it one way (one iteration, or ``result()``); ``result()`` after a completed
    iteration returns the same result. Closing an iteration early, or interrupting a
    ``result()`` wait, aborts the request. Thread-safe. Memory: the undelivered deltas (O(output
    tokens)).
    """

    __slots__ = (
        "_abort_request",
        "_async_wake",
        "_end_lock",
        "_finish",
        "_flight",
        "_inbox",
        "_lock",
        "_outcome",
        "_wake",
    )

    def __init__(
        self,
        start: Start,
        abort_request: Callable[[str], object],
        finish: Callable[[InFlight], GenerationResult] | None = None,
    ) -> None:
        """Start the request now (``start``; its errors propagate and nothing is started).
        ``abort_request(request_id)`` stops it in the driver; ``finish`` ends it once done
        (default :func:`finish_request`)."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: deque[tuple[StepOutput, float]] = deque()  # owner: _lock
        self._async_wake: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._end_lock = threading.Lock()
        self._outcome: GenerationResult | BaseException | None = None  # owner: _end_lock
        self._abort_request = abort_request
        self._finish = finish or finish_request
        self._flight = start(self._on_delta, self._on_done)

    @property
    def request_id(self) -> str:
        return self._flight.state.request_id

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The exact prompt sent to the model, as token ids: known from submission (the
        constructor planned and rendered it), before the first token; the same tuple as the
        result's ``prompt_token_ids``. Read-only, O(1)."""
        return self._flight.token_ids

    def done(self) -> bool:
        """Whether the engine is done with the request (finished, failed or aborted)."""
        return self._flight.state.done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until :meth:`done` (at most ``timeout`` seconds); commits nothing."""
        return self._flight.state.done.wait(timeout)

    # ---- the driver's side (its thread; O(1) each) ----

    def _on_delta(self, out: StepOutput, now: float) -> None:
        with self._lock:
            self._inbox.append((out, now))
            self._notify()

    def _on_done(self) -> None:
        with self._lock:
            self._notify()

    def _notify(self) -> None:
        self._wake.notify_all()
        if self._async_wake is not None:
            loop, event = self._async_wake
            loop.call_soon_threadsafe(event.set)

    # ---- the consumer's side ----

    def result(self) -> GenerationResult:
        """Wait until done; the first call commits the turn. Raises the request's error
        (:class:`~craft_rag.engine.driver.EngineFailure`, ``RequestCancelled`` after
        :meth:`abort`, a commit's error); interrupting the wait aborts the request."""
        try:
            self._flight.state.done.wait()
        except BaseException:
            self.abort()
            raise
        return self._end()

    async def aresult(self) -> GenerationResult:
        """Async :meth:`result`: waits on the async iteration, so the event loop never blocks
        on the engine; cancelling the waiter aborts the request."""
        async with aclosing(self.__aiter__()) as pieces:
            async for piece in pieces:
                if piece.result is not None:
                    return piece.result
        msg = f"request {self.request_id} ended without a result"  # iteration raises instead
        raise RuntimeError(msg)

    def abort(self) -> bool:
        """Stop the request if it has not ended: the driver aborts it and the turn is given up
        (nothing committed); a later ``result()`` raises ``RequestCancelled``. Returns whether
        it ended the request (``False`` once finished or aborted). Idempotent."""
        with self._end_lock:
            if self._outcome is not None:
                return False
            state = self._flight.state
            self._abort_request(state.request_id)
            cancelled = RequestCancelled(f"request {state.request_id} was aborted")
            self._outcome = state.error or cancelled
            if self._flight.turn is not None:
                self._flight.turn.give_up()
            return True

    def __iter__(self) -> Iterator[StreamChunk]:
        """Yield the reply's pieces as the driver produces them (blocking the thread)."""
        try:
            while (item := self._next()) is not None:
                if (piece := self._piece(*item)) is not None:
                    yield piece
            yield self._final()
        finally:
            self.abort()  # closed early; a no-op once the request ended

    async def __aiter__(self) -> AsyncGenerator[StreamChunk, None]:
        """Async iteration: the consumer's loop is woken per delta; cancelling or closing the
        consumer aborts the request. Wrap it in ``contextlib.aclosing`` to abort at once."""
        event = asyncio.Event()
        with self._lock:
            self._async_wake = (asyncio.get_running_loop(), event)
        try:
            while (item := await self._anext(event)) is not None:
                if (piece := self._piece(*item)) is not None:
                    yield piece
            yield self._final()
        finally:
            with self._lock:
                self._async_wake = None  # this loop may close; wake nobody through it
            self.abort()  # closed or cancelled early; a no-op once the request ended

    async def _anext(self, event: asyncio.Event) -> tuple[StepOutput, float] | None:
        """The next delta (``None``: done); waits on ``event``, set from the driver thread
        through the loop after every delta (cleared before each look, so none is missed)."""
        while True:
            event.clear()
            with self._lock:
                if self._inbox:
                    return self._inbox.popleft()
                if self.done():
                    return None
            await event.wait()

    def _next(self) -> tuple[StepOutput, float] | None:
        with self._lock:
            while not self._inbox and not self.done():
                self._wake.wait()
            return self._inbox.popleft() if self._inbox else None

    def _piece(self, out: StepOutput, now: float) -> StreamChunk | None:
        if not out.new_token_ids and not out.new_text:
            return None
        elapsed = (now - self._flight.state.submitted_at) * 1000.0
        return StreamChunk(text=out.new_text, token_ids=out.new_token_ids, elapsed_ms=elapsed)

    def _final(self) -> StreamChunk:
        result = self._end()
        return StreamChunk(
            text="", token_ids=(), elapsed_ms=result.report.latency_ms, result=result
        )

    def _end(self) -> GenerationResult:
        """Finish once (commit or give up), then return or raise the cached outcome."""
        with self._end_lock:
            if self._outcome is None:
                try:
                    self._outcome = self._finish(self._flight)
                except BaseException as exc:
                    self._outcome = exc
            outcome = self._outcome
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def finish_request(flight: InFlight) -> GenerationResult:
    """Commit a finished request and build its result; on failure, give the turn up and raise."""
    error, turn = flight.state.error, flight.turn
    if turn is None:
        if error is not None:
            raise error
        return result_of(flight, plain_report(flight))
    try:
        if error is not None:
            raise error
        return turn.commit(flight)
    except BaseException:
        turn.give_up()
        raise


def plain_report(flight: InFlight) -> ReuseReport:
    """The report of a prompt without chunks (a RAG turn's commit replaces the plan fields)."""
    state = flight.state
    first = state.first_token_at if state.first_token_at is not None else state.finished_at
    end = state.finished_at if state.finished_at is not None else state.submitted_at
    cached = state.num_cached_tokens or 0
    ram, disk = state.tier_ram_tokens, state.tier_disk_tokens
    # Tier tokens are part of the cached ones: counts that disagree say nothing.
    if ram + disk > cached:
        ram = disk = 0
    return ReuseReport(
        request_id=state.request_id,
        prompt_tokens=len(flight.token_ids),
        cached_tokens=cached,
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
        read_prefix_cache=flight.sampling.read_prefix_cache,
        salted=flight.cache_salt is not None,
        tier_ram_tokens=ram,
        tier_disk_tokens=disk,
        admission_held_ms=None if state.held_s is None else state.held_s * 1000.0,
        **chunk_reuse_fields(state),
    )


def chunk_reuse_fields(state: RequestState) -> dict[str, Any]:
    """The :class:`ReuseReport` fields of the approximate connector's counts (chunk spans
    sent); none (the defaults) when the request sent none or the counts did not add up."""
    counts = state.reuse_counts
    if counts is None:
        return {}
    return {
        "approximate": counts.refused is None and counts.fixed > 0,
        "exact_reused_tokens": counts.exact,
        "fixed_tokens": counts.fixed,
        "recomputed_tokens": counts.recomputed,
        "computed_tokens": counts.computed,
        "chunk_cache_refused": counts.refused,
    }


def result_of(flight: InFlight, report: ReuseReport) -> GenerationResult:
    """The finished request's result with ``report``."""
    state = flight.state
    return GenerationResult(
        text=state.text,
        token_ids=tuple(state.token_ids),
        finish_reason=state.finish_reason,
        report=report,
        prompt_token_ids=flight.token_ids,
    )


# ---- the public forms over submit --------------------------------------------------------------


def stream_of(submit: Callable[[], RequestHandle]) -> Iterator[StreamChunk]:
    """A stream that submits when first advanced; closing it early aborts the request."""
    yield from submit()


async def astream_of(submit: Callable[[], RequestHandle]) -> AsyncGenerator[StreamChunk, None]:
    """Async :func:`stream_of`. ``aclosing``: closing this generator closes the handle's at
    once (and aborts), not when it is garbage-collected."""
    async with aclosing(submit().__aiter__()) as pieces:
        async for piece in pieces:
            yield piece


def submit_batch(
    submit: Callable[[RagRequest], RequestHandle],
    requests: Sequence[RagRequest],
    sampling: SamplingRequest | None,
    **overrides: object,
) -> list[GenerationResult]:
    """Submit every request (in order, before any is waited for), then wait for all and
    finish each; the first error is raised after every request ended. ``sampling`` (with
    ``overrides``) replaces each request's own when given. A conversation may appear once
    (``ValueError``); a request that cannot start gives up the ones already started."""
    if sampling is not None or any(v is not None for v in overrides.values()):
        requests = [
            replace(r, sampling=(sampling or r.sampling).with_overrides(**overrides))
            for r in requests
        ]
    named = [c for r in requests if (c := r.conversation_id or _plan_conversation(r))]
    if len(named) != len(set(named)):
        msg = "a conversation may appear at most once per batch (its turns are sequential)"
        raise ValueError(msg)
    handles: list[RequestHandle] = []
    try:
        for request in requests:
            handles.append(submit(request))
        for handle in handles:
            handle.wait()
    except BaseException:
        for handle in handles:
            handle.abort()
        raise
    results: list[GenerationResult] = []
    error: BaseException | None = None
    for handle in handles:
        try:
            results.append(handle.result())
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error
    return results


def _plan_conversation(request: RagRequest) -> str | None:
    conversation = getattr(request.plan, "conversation_id", None)
    return conversation if isinstance(conversation, str) else None
