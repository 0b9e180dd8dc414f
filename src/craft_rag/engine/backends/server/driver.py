"""Requests to a vLLM server in flight: one thread per request, pushing deltas to its state.

The in-process :class:`craft_rag.engine.driver.EngineDriver` steps an engine; a server steps
itself, and each request is an independent HTTP stream. So this driver has the same surface
(``submit``/``abort``/``exclusive``/``in_flight``/``close``/``clock``) and feeds the same
:class:`craft_rag.engine.driver.RequestState`, which is what lets :class:`CraftEngine` keep one
request path (plan, render, commit) for both. Why threads and not an event loop: the sync API
must work without a running loop, requests are few and long (seconds of prefill/decode), and
``httpx.Client`` is thread-safe.

Locking: ``_cond`` guards the request table only; deltas are delivered outside it. A request's
thread is the only writer of its state until ``done`` is set (``abort`` marks it cancelled
and fails it; the thread then delivers nothing more).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from craft_rag.engine.backends.server.backend import ServerBackend, step_output
from craft_rag.engine.backends.server.settings import ServerUnavailable
from craft_rag.engine.driver import (
    EngineFailure,
    RequestCancelled,
    RequestState,
    RequestTable,
    aborted_error,
)
from craft_rag.engine.results import SamplingRequest

if TYPE_CHECKING:
    from craft_rag.engine.admission import Admission

T = TypeVar("T")


class ServerDriver(RequestTable[tuple[RequestState, threading.Event]]):
    """Streams requests to ``backend``'s server on one daemon thread each.

    ``on_server_lost`` runs (on the request's thread) when the server is unreachable or drops
    a stream: the engine clears its CP-Trees there, since a restarted server's cache is empty.
    Cost per request: one thread and one pooled HTTP connection while it runs.
    """

    def __init__(
        self,
        backend: ServerBackend,
        *,
        on_server_lost: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        admission: Admission | None = None,
    ) -> None:
        """``admission`` (its priority form only): each request's body carries ``priority``,
        its admission key; the server must run ``--scheduling-policy priority``."""
        super().__init__(clock)
        self._backend = backend
        self._admission = admission
        self._on_lost = on_server_lost
        self._exclusive = threading.Lock()
        self._threads: set[threading.Thread] = set()  # owner: _cond

    def _entry(self, state: RequestState) -> tuple[RequestState, threading.Event]:
        return state, threading.Event()  # set: stop streaming

    def _start(
        self,
        token_ids: tuple[int, ...],
        sampling: SamplingRequest,
        entry: tuple[RequestState, threading.Event],
        cache_salt: str | None,
    ) -> None:
        """Stream the request on its own thread. Errors (server down, HTTP errors) arrive as
        ``state.error`` (raised by the engine when the request is finished)."""
        state, cancelled = entry
        priority = None
        if self._admission is not None:
            priority = self._admission.key(state.predicted_cached_tokens, len(token_ids))
            state.held_s = 0.0  # the server holds and orders it
        thread = threading.Thread(
            target=self._run,
            args=(token_ids, sampling, state, cache_salt, cancelled, priority),
            name=f"craft-server-{state.request_id}",
            daemon=True,
        )
        with self._cond:
            self._threads.add(thread)
        thread.start()

    def _run(
        self,
        token_ids: tuple[int, ...],
        sampling: SamplingRequest,
        state: RequestState,
        cache_salt: str | None,
        cancelled: threading.Event,
        priority: int | None = None,
    ) -> None:
        try:
            stream = (
                self._backend.stream(token_ids, sampling, cache_salt, cancelled)
                if priority is None
                else self._backend.stream(
                    token_ids, sampling, cache_salt, cancelled, priority=priority
                )
            )
            for delta in stream:
                out = step_output(state.request_id, delta)
                if out.finished and self._pop(state.request_id) is None:
                    return  # aborted meanwhile: abort already failed the state
                if cancelled.is_set():
                    return
                try:
                    state._deliver(out, self._clock())
                except Exception as exc:  # the consumer's callback broke: fail this request
                    cancelled.set()
                    self._fail(state, exc)
                    return
        except ServerUnavailable as exc:
            if self._on_lost is not None:
                self._on_lost()
            self._fail(state, exc)
        except Exception as exc:
            self._fail(state, exc if isinstance(exc, EngineFailure | ValueError) else _wrap(exc))
        finally:
            with self._cond:
                self._threads.discard(threading.current_thread())

    def _fail(self, state: RequestState, error: BaseException) -> None:
        self._pop(state.request_id)
        if not state.done.is_set():
            state._fail(error, self._clock())

    def abort(self, request_id: str) -> bool:
        """Stop a running request (its stream is closed, so the server aborts it too); its
        state fails with :class:`RequestCancelled`. Returns whether it was running."""
        entry = self._pop(request_id)
        if entry is None:
            return False
        state, stop = entry
        stop.set()
        state._fail(aborted_error(request_id), self._clock())
        return True

    def exclusive(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (e.g. a cache reset) serialised with other exclusive calls. Requests
        keep streaming: the server orders the reset itself."""
        with self._exclusive:
            return fn()

    def close(self) -> None:
        """Cancel whatever is in flight (:class:`RequestCancelled`) and wait briefly for the
        request threads to notice. Idempotent."""
        with self._cond:
            threads = list(self._threads)
        now, entries = self._clock(), self._close_table()
        for state, stop in entries:
            stop.set()
            if not state.done.is_set():
                state._fail(RequestCancelled("the engine was closed"), now)
        for thread in threads:
            thread.join(timeout=2.0)


def _wrap(exc: Exception) -> EngineFailure:
    error = EngineFailure(f"the server request failed: {exc!r}")
    error.__cause__ = exc
    return error
