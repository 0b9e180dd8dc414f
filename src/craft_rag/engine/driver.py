"""One thread that steps the engine; sync and streaming requests both wait on it.

Why a driver thread: vLLM's ``AsyncLLM`` always runs the engine core in a subprocess (slower
start-up, a ``__main__`` guard in every script). Stepping the in-process ``LLMEngine`` from one
daemon thread gives the same streaming (``RequestOutputKind.DELTA``) in-process, and one code
path for sync ``generate``, the sync ``stream`` iterator and async ``astream``: each registers a
:class:`RequestState` and waits on it (an ``Event``, a thread queue or an asyncio queue).

Locking: ``_engine_lock`` serialises every call into the backend (add, step, abort, reset), so
vLLM is never entered from two threads at once; ``_cond`` guards the request table. The lock
order is always ``_cond`` released before ``_engine_lock`` is taken, so they cannot deadlock.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from craft_rag.engine.results import SamplingRequest, StepOutput
from craft_rag.kvtiers.approx_params import ReuseCounts
from craft_rag.scheduling.admission import AdmissionQueue

if TYPE_CHECKING:
    from craft_rag.engine.admission import Admission

T = TypeVar("T")
E = TypeVar("E")


class EngineBackend(Protocol):
    """The engine operations the driver needs; :class:`craft_rag.engine.backends.vllm.backend.
    VLLMBackend` implements them over vLLM. None of these is called concurrently.

    ``add_request`` is called with ``cache_salt=`` only for salted requests, so a backend
    without salt support still serves unsalted ones (the engine refuses salts for it), and
    with ``priority=`` only under priority admission (:mod:`craft_rag.engine.admission`), so a
    backend that takes no priority serves every request while admission is off."""

    def add_request(
        self,
        request_id: str,
        token_ids: Sequence[int],
        sampling: SamplingRequest,
        cache_salt: str | None = None,
        priority: int | None = None,
    ) -> None: ...

    def step(self) -> list[StepOutput]: ...

    def abort(self, request_ids: Sequence[str]) -> None: ...

    def has_unfinished(self) -> bool: ...


class EngineFailure(RuntimeError):
    """The engine raised while serving a request; the request produced no result."""


class RequestCancelled(RuntimeError):
    """The request was aborted before it finished (consumer stopped, or the engine closed)."""


class RequestIds:
    """Request ids ``craft-1``, ``craft-2``, ... for one engine (RAG turns and plain prompts
    share it). Thread-safe (``itertools.count`` advances atomically under the GIL). O(1)."""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def __call__(self) -> str:
        return f"craft-{next(self._next)}"


class Submits(Protocol):
    """A driver, as :class:`SubmitTo` uses it (this module's and the server backend's)."""

    def submit(
        self,
        token_ids: Sequence[int],
        sampling: SamplingRequest,
        state: RequestState,
        *,
        cache_salt: str | None = None,
    ) -> None: ...


class SubmitTo:
    """A RAG turn's submit step: ``driver.submit`` as it is at call time (a wrapper or a test's
    spy put on the driver after the engine was built is seen), keyword ``cache_salt``. O(1)."""

    __slots__ = ("_driver",)

    def __init__(self, driver: Submits) -> None:
        self._driver = driver

    def __call__(
        self,
        token_ids: tuple[int, ...],
        sampling: SamplingRequest,
        state: RequestState,
        *,
        cache_salt: str | None,
    ) -> None:
        self._driver.submit(token_ids, sampling, state, cache_salt=cache_salt)


@dataclass(slots=True, eq=False)
class RequestState:
    """Progress of one request. Fields below ``done`` are written only by the driver thread
    until ``done`` is set; read them after ``done.wait()``. ``on_delta`` runs on the driver
    thread with each delta and the time it arrived: keep it O(1) (a queue put).
    ``predicted_cached_tokens`` (set by whoever makes the state, before submitting: a RAG
    turn's :func:`~craft_rag.engine.rag_turn.predicted_cached_tokens`) ranks the request
    under cache-aware admission."""

    request_id: str
    on_delta: Callable[[StepOutput, float], object] | None = None
    on_done: Callable[[], object] | None = None
    predicted_cached_tokens: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int | None = None
    tier_ram_tokens: int = 0
    tier_disk_tokens: int = 0
    reuse_counts: ReuseCounts | None = None
    error: BaseException | None = None
    held_s: float | None = None
    """Seconds craft-rag's admission queue held the request (0 when vLLM's priority scheduler
    ordered it; ``None`` with admission off)."""

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def _deliver(self, out: StepOutput, now: float) -> None:
        if out.new_token_ids and self.first_token_at is None:
            self.first_token_at = now
        self.token_ids.extend(out.new_token_ids)
        self.text_parts.append(out.new_text)
        if out.num_cached_tokens is not None:
            self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.finished_at = now
            # The connector reports tier counts once, when the request finishes.
            self.tier_ram_tokens = out.tier_ram_tokens
            self.tier_disk_tokens = out.tier_disk_tokens
            self.reuse_counts = out.reuse_counts
        if self.on_delta is not None:
            self.on_delta(out, now)
        if out.finished:
            self._finish()

    def _fail(self, error: BaseException, now: float) -> None:
        self.error = error
        self.finished_at = now
        self._finish()

    def _finish(self) -> None:
        self.done.set()
        if self.on_done is not None:
            self.on_done()


class RequestTable(Generic[E]):
    """The bookkeeping both drivers share: requests in flight by id (each with the driver's
    entry ``E``: its state and whatever the driver needs to stop it), the closed flag and the
    clock. ``_cond`` guards the table; nothing slow runs under it. O(1) per operation."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._states: dict[str, E] = {}  # owner: guarded by _cond
        self._closed = False

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    def in_flight(self) -> int:
        with self._cond:
            return len(self._states)

    def _register(self, state: RequestState, entry: E) -> None:
        """Add a request. ``RuntimeError`` once closed or for an id already in flight. Call
        under ``_cond``."""
        if self._closed:
            msg = "the engine is closed; create a new CraftEngine"
            raise RuntimeError(msg)
        if state.request_id in self._states:
            msg = f"request id {state.request_id!r} is already in flight"
            raise RuntimeError(msg)
        self._states[state.request_id] = entry

    def submit(
        self,
        token_ids: Sequence[int],
        sampling: SamplingRequest,
        state: RequestState,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Start a request (``cache_salt``: its prefix-cache namespace); its deltas go to
        ``state``. It is registered first, so no output arrives that cannot be routed; an error
        starting it unregisters it and propagates (see each driver's ``_start``)."""
        entry = self._entry(state)
        with self._cond:
            self._register(state, entry)
        state.submitted_at = self._clock()
        try:
            self._start(tuple(token_ids), sampling, entry, cache_salt)
        except BaseException:
            self._pop(state.request_id)
            raise

    def _entry(self, state: RequestState) -> E:
        """The table entry of a new request (the driver's hook)."""
        raise NotImplementedError

    def _start(
        self,
        token_ids: tuple[int, ...],
        sampling: SamplingRequest,
        entry: E,
        cache_salt: str | None,
    ) -> None:
        """Hand a registered request to the backend (the driver's hook)."""
        raise NotImplementedError

    def _pop(self, request_id: str) -> E | None:
        with self._cond:
            return self._states.pop(request_id, None)

    def _close_table(self) -> list[E]:
        """Mark closed, empty the table and wake any waiter; returns the entries in flight."""
        with self._cond:
            self._closed = True
            entries = list(self._states.values())
            self._states.clear()
            self._cond.notify_all()
        return entries


def aborted_error(request_id: str) -> RequestCancelled:
    """The error of a request stopped by ``abort``."""
    return RequestCancelled(f"request {request_id} was aborted")


@dataclass(frozen=True, slots=True)
class _Held:
    """A request in craft-rag's admission queue: what ``add_request`` needs later."""

    token_ids: tuple[int, ...]
    sampling: SamplingRequest
    state: RequestState
    cache_salt: str | None


class EngineDriver(RequestTable[RequestState]):
    """Steps ``backend`` on a daemon thread while any request is unfinished.

    ``admission`` (:mod:`craft_rag.engine.admission`): with ``uses_priority`` each request
    goes to the backend at once with ``priority=`` its key; with ``max_running`` requests wait
    in an :class:`~craft_rag.scheduling.admission.AdmissionQueue` (owned under ``_cond``) and
    at most that many are in the backend (``_running``). ``_admit_lock`` keeps the queue's
    order into the backend; lock order: ``_admit_lock``, then ``_cond`` (released), then
    ``_engine_lock``.

    Cost: one ``backend.step()`` per iteration (a forward pass over the batch); dispatching a
    delta is O(1); admission O(log n) per request.
    """

    def __init__(
        self,
        backend: EngineBackend,
        *,
        clock: Callable[[], float] = time.perf_counter,
        admission: Admission | None = None,
    ) -> None:
        super().__init__(clock)
        self._backend = backend
        self._engine_lock = threading.Lock()
        self._admission = admission
        self._queue: AdmissionQueue[_Held] | None = None  # owner: guarded by _cond
        if admission is not None and admission.max_running is not None:
            self._queue = AdmissionQueue(admission.order, clock=clock)
        self._running: set[str] = set()  # owner: guarded by _cond (queue mode only)
        self._admit_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="craft-engine-driver", daemon=True)
        self._thread.start()

    def _entry(self, state: RequestState) -> RequestState:
        return state

    def _start(
        self,
        token_ids: tuple[int, ...],
        sampling: SamplingRequest,
        entry: RequestState,
        cache_salt: str | None,
    ) -> None:
        """Queue the request in the backend (errors from ``add_request``, e.g. an invalid
        prompt, propagate) and wake the stepping thread; under queue admission, hold it and
        let in what fits (an error then fails the request instead)."""
        admission, priority = self._admission, None
        if admission is not None:
            key = admission.key(entry.predicted_cached_tokens, len(token_ids))
            if self._queue is not None:
                with self._cond:
                    held = _Held(token_ids, sampling, entry, cache_salt)
                    self._queue.push_keyed(entry.request_id, held, key)
                self._admit()
                return
            priority, entry.held_s = key, 0.0
        self._add(entry.request_id, token_ids, sampling, cache_salt, priority)
        with self._cond:
            self._cond.notify_all()

    def _add(
        self,
        request_id: str,
        token_ids: tuple[int, ...],
        sampling: SamplingRequest,
        cache_salt: str | None,
        priority: int | None,
    ) -> None:
        with self._engine_lock:
            if priority is not None:
                self._backend.add_request(
                    request_id, token_ids, sampling, cache_salt=cache_salt, priority=priority
                )
            elif cache_salt is None:
                self._backend.add_request(request_id, token_ids, sampling)
            else:
                self._backend.add_request(request_id, token_ids, sampling, cache_salt=cache_salt)

    def _admit(self) -> None:
        """Move held requests into the backend, lowest key first, while fewer than
        ``max_running`` are there. O(log n) per request let in."""
        if self._queue is None:
            return
        assert self._admission is not None and self._admission.max_running is not None
        limit = self._admission.max_running
        with self._admit_lock:
            while True:
                with self._cond:
                    if len(self._running) >= limit or (admitted := self._queue.pop()) is None:
                        return
                    self._running.add(admitted.request_id)
                held, rid = admitted.item, admitted.request_id
                held.state.held_s = admitted.held_s
                try:
                    self._add(rid, held.token_ids, held.sampling, held.cache_salt, None)
                except Exception as exc:  # e.g. a prompt too long: fail only this request
                    with self._cond:
                        self._running.discard(rid)
                    if self._pop(rid) is not None:
                        held.state._fail(exc, self._clock())
                    continue
                with self._cond:
                    alive = rid in self._states
                    self._cond.notify_all()
                if not alive:  # aborted between leaving the queue and entering the backend
                    self._abort_in_backend(rid)

    def _abort_in_backend(self, request_id: str) -> None:
        with self._engine_lock:
            self._backend.abort([request_id])
        with self._cond:
            self._running.discard(request_id)

    def abort(self, request_id: str) -> bool:
        """Stop a request if still running or held (its state fails with
        :class:`RequestCancelled`). Returns whether it was running."""
        state = self._pop(request_id)
        if state is None:
            return False
        with self._cond:
            held = self._queue.remove(request_id) if self._queue is not None else None
        if held is None:
            self._abort_in_backend(request_id)
        state._fail(aborted_error(request_id), self._clock())
        self._admit()
        return True

    def exclusive(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` while no step is in progress (e.g. ``reset_prefix_cache``)."""
        with self._engine_lock:
            return fn()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._states and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
            try:
                with self._engine_lock:
                    outputs = self._backend.step()
            except Exception as exc:  # the engine failed: fail every waiter, keep serving
                self._fail_all(exc)
                continue
            now = self._clock()
            finished = False
            for out in outputs:
                with self._cond:
                    if out.finished:
                        finished = True
                        self._running.discard(out.request_id)
                    state = (
                        self._states.pop(out.request_id, None)
                        if out.finished
                        else self._states.get(out.request_id)
                    )
                if state is None:
                    continue
                try:
                    state._deliver(out, now)
                except Exception as exc:  # a consumer's callback broke: fail only that request
                    self._drop(state, exc, now)
            if finished:
                self._admit()

    def _drop(self, state: RequestState, error: BaseException, now: float) -> None:
        """Stop one request on the driver's side (its consumer failed) and fail it."""
        if self._pop(state.request_id) is not None:
            self._abort_in_backend(state.request_id)
        if not state.done.is_set():
            state._fail(error, now)
        self._admit()

    def _fail_all(self, exc: Exception) -> None:
        with self._cond:
            states = list(self._states.values())
            self._states.clear()
            self._running.clear()
            if self._queue is not None:
                self._queue.drain()
        try:
            with self._engine_lock:
                self._backend.abort([s.request_id for s in states])
        except Exception:  # best effort: the engine is already failing
            pass
        now = self._clock()
        error = EngineFailure(f"the engine failed while serving the request: {exc!r}")
        error.__cause__ = exc
        for state in states:
            state._fail(error, now)

    def close(self) -> None:
        """Fail whatever is in flight with :class:`RequestCancelled` and stop the thread."""
        now, states = self._clock(), self._close_table()
        with self._cond:
            if self._queue is not None:
                self._queue.drain()
        for state in states:
            state._fail(RequestCancelled("the engine was closed"), now)
        self._thread.join(timeout=30)
