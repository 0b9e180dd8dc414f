"""Several vLLM servers behind one engine: one :class:`CraftEngine` per server URL (its own
backend, KV events, planners and conversation histories: that replica's CP-Trees) and one
:class:`~craft_rag.routing.Router` reading those planners, so placement and chunk order are
chosen together (``routing="craft_joint"``).

A request is routed (:meth:`ReplicaSet.start_attempt`: the router picks the replica and plans
the chunk order on that replica's planner), served on the chosen replica's engine with the
router's plan (``plan=``: that engine commits it to its own tree, with its own reuse report),
and finished in the router (its load leaves the replica). Conversations stay on their replica
while it is healthy; a replica that refuses connections or drops a request
(:class:`~craft_rag.engine.backends.server.settings.ServerUnavailable`) is marked down: its
trees are dropped and its conversations re-homed: each one's history (client-side state, held
in this process) moves to its new home's engine, so its next turn continues there with its
earlier turns in the prompt, computed from scratch (``ReuseReport.rehomed``). A request that
failed there before its first token is retried on another replica (:class:`RoutedRequest`;
``ReuseReport.retries``). A replica that is down is probed at most every ``probe_interval_s``
(in the background, when requests arrive) and rejoins empty (a fresh planner: no trees, no
conversations) once it answers.

State owners: the router owns placement state (homes, loads, health); each replica's engine
owns its trees and histories (its KV events keep them true). The router's state is kept behind
its own public methods (``route``/``finish``/``mark_down``/``mark_up``/``home``), so a shared
implementation (issue 29, item 2) can replace it without touching this module's flow.

Lock order: a :class:`RoutedRequest`'s lock, then the router's (then a planner's); the replica
set's own lock guards only the probe bookkeeping and is never held while calling out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from craft_rag.engine.backends.server.settings import ServerSettings, ServerUnavailable
from craft_rag.engine.driver import RequestState
from craft_rag.engine.requests import InFlight, OnDelta, OnDone, finish_request
from craft_rag.engine.results import (
    EngineRequest,
    GenerationResult,
    RagRequest,
    SamplingRequest,
    StepOutput,
    TokensRequest,
)
from craft_rag.planner import CraftPlanner
from craft_rag.routing.replica import ReplicaId
from craft_rag.routing.router import FaultReport, RouteDecision, Router
from craft_rag.validation import validate_cache_salt

if TYPE_CHECKING:
    from craft_rag.engine.engine import CraftEngine

__all__ = [
    "DEFAULT_PROBE_INTERVAL_S",
    "ReplicaSet",
    "RoutedRequest",
    "replica_names",
]

_log = logging.getLogger(__name__)

DEFAULT_PROBE_INTERVAL_S = 5.0
"""Seconds between health probes of a replica that is down."""


def replica_names(servers: Sequence[str | ServerSettings]) -> list[ReplicaId]:
    """Each server's replica id: its URL without credentials (``scheme://host:port``).
    ``ValueError`` for an empty list, an entry that is neither, or the same server twice."""
    if isinstance(servers, str) or not isinstance(servers, Sequence) or not servers:
        msg = "server= takes a URL, a ServerSettings, or a non-empty list of them"
        raise ValueError(msg)
    names: list[ReplicaId] = []
    for i, spec in enumerate(servers):
        if isinstance(spec, str):
            spec = ServerSettings(spec)
        if not isinstance(spec, ServerSettings):
            msg = f"server[{i}] is a {type(spec).__name__}; pass a URL string or ServerSettings"
            raise ValueError(msg)
        names.append(ReplicaId(spec.base_url))
    if len(set(names)) != len(names):
        msg = f"server= names the same server twice: {names}; list each replica once"
        raise ValueError(msg)
    return names


@dataclass(slots=True, eq=False)
class Attempt:
    """One try of a request on one replica. ``flight`` is set once the replica's engine started
    it; ``done_early``: its done callback ran before that (handled after the start)."""

    replica: ReplicaId
    decision: RouteDecision
    flight: InFlight | None = None
    done_early: bool = False
    handled: bool = False  # its end was acted on (retried or ended): at most once


class ReplicaSet:
    """The replicas' engines and the router over them. Owns both; :meth:`close` closes the
    engines. Thread-safe (each engine and the router are)."""

    def __init__(
        self,
        engines: dict[ReplicaId, CraftEngine],
        router: Router,
        planner_config_of: Callable[[], CraftPlanner],
        *,
        probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        shared_planners: bool = False,
    ) -> None:
        """``shared_planners``: the engines' planners live in a store shared with other app
        workers (``store=``): a replica that rejoins keeps its (emptied) shared planners, and
        a re-homed conversation's history is not carried (its next turn starts over)."""
        self.engines = engines  # read-only after construction
        self._shared_planners = shared_planners
        self.router = router
        self._fresh_planner = planner_config_of
        self._probe_interval_s = probe_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last_probe = clock()  # owner: _lock
        self._probing = False  # owner: _lock
        self.faults: list[FaultReport] = []  # owner: _lock (appended on each mark_down)

    # ---- routing one attempt --------------------------------------------------------------

    def start_attempt(
        self,
        request: EngineRequest,
        attempt_done: Callable[[Attempt], None],
        on_delta: OnDelta,
    ) -> Attempt:
        """Route ``request`` and start it on the chosen replica's engine; ``attempt_done``
        runs (on that engine's thread) when it ends. Raises (nothing left in flight: the
        decision is finished, the plan aborted) when it cannot start. Cost: one route (the
        policy plus a plan) and the engine's render."""
        self._maybe_probe()
        salt = validate_cache_salt(request.cache_salt)
        if isinstance(request, RagRequest):
            if request.plan is not None:
                msg = (
                    "plan= is not taken with several servers: the router plans each request "
                    "on the replica it chooses; pass the chunks and let the engine route them"
                )
                raise ValueError(msg)
            chunks = tuple(request.chunks)
            conversation_id = request.conversation_id
            prompt_tokens = self._prompt_tokens(request, salt)
        else:
            chunks, conversation_id = (), None
            first = next(iter(self.engines.values()))
            if isinstance(request, TokensRequest):
                prompt_tokens = max(1, len(request.token_ids))
            else:
                prompt_tokens = max(1, len(first.message_token_ids(request.messages)))
        decision = self.router.route(
            chunks, prompt_tokens=prompt_tokens, conversation_id=conversation_id, salt=salt
        )
        engine = self.engines[decision.replica]
        if not isinstance(request, RagRequest):
            # The router plans every request; a prompt without chunks has nothing to commit.
            engine.planner_for(salt).abort(decision.plan)
        attempt = Attempt(decision.replica, decision)
        routed: EngineRequest = request
        if isinstance(request, RagRequest):
            routed = replace(request, chunks=decision.plan.ordered, plan=decision.plan)
        try:
            attempt.flight = engine._start(routed, on_delta, lambda: attempt_done(attempt))
        except BaseException as exc:
            self._settle(attempt)
            if isinstance(exc, ServerUnavailable):  # refused at the start: the replica is lost
                self.mark_down(decision.replica)
            raise
        return attempt

    def _prompt_tokens(self, request: RagRequest, salt: str | None) -> int:
        """The prompt's length as the router counts load: the single-turn prompt plus, for a
        conversation, its home's stored history. The home makes room for the turn first
        (``fit_turn``), so the plan's dedup counts only chunks still in the prompt."""
        home = None
        if request.conversation_id is not None:
            home = self.router.home(request.conversation_id, salt=salt)
        engine = self.engines[home] if home is not None else next(iter(self.engines.values()))
        history = 0
        if home is not None and request.conversation_id is not None:
            engine.fit_turn(
                request.chunks,
                request.question,
                conversation_id=request.conversation_id,
                max_tokens=request.sampling.max_tokens,
                cache_salt=salt,
            )
            history = engine.prompt_renderer.history_tokens(request.conversation_id, salt)
        single = engine.assembler.single_turn(request.chunks, request.question).num_tokens
        return max(1, single + history)

    def finish_attempt(self, attempt: Attempt) -> GenerationResult:
        """Commit the attempt on its replica (its engine's own commit) and finish it in the
        router; on an error the turn is given up there and the plan aborted, then it raises."""
        flight = attempt.flight
        assert flight is not None
        try:
            return finish_request(flight)
        except BaseException:
            self._abort_plan(attempt)
            raise
        finally:
            self.router.finish(attempt.decision)

    def give_up_attempt(self, attempt: Attempt) -> None:
        """The attempt will not be committed: its turn is given up on its replica, the plan
        aborted there, its load finished in the router. Idempotent."""
        flight = attempt.flight
        if flight is not None and flight.turn is not None:
            flight.turn.give_up()
        self._settle(attempt)

    def abort_attempt(self, attempt: Attempt) -> None:
        """Stop the attempt's request in its replica's driver (its done callback follows)."""
        if attempt.flight is not None:
            self.engines[attempt.replica]._driver.abort(attempt.flight.state.request_id)

    def _settle(self, attempt: Attempt) -> None:
        self._abort_plan(attempt)
        self.router.finish(attempt.decision)

    def _abort_plan(self, attempt: Attempt) -> None:
        engine = self.engines[attempt.replica]
        engine.planner_for(attempt.decision.salt).abort(attempt.decision.plan)

    # ---- health ---------------------------------------------------------------------------

    def mark_down(self, replica: str) -> FaultReport:
        """``replica`` is unreachable: the router drops its trees and load and re-homes its
        conversations (:class:`FaultReport`). Idempotent."""
        report = self.router.mark_down(replica)
        if report.rehomed and not self._shared_planners:
            # With a store the histories are the store's (another worker may hold the turns);
            # importing one is refused there, so the next turn starts over on its new home.
            self._carry_histories(ReplicaId(replica), report)
        with self._lock:
            if report.nodes_dropped or report.inflight_lost or report.rehomed:
                self.faults.append(report)
            self._last_probe = self._clock()
        return report

    def _carry_histories(self, lost: ReplicaId, report: FaultReport) -> None:
        """Move each re-homed conversation's history (client-side state: this process's, not
        the lost server's) from the lost replica's engine to its new home's, then drop it
        there: its next turn continues there (its earlier turns in the prompt, computed from
        scratch). A turn in flight on the lost replica is not carried (it is given up or
        retried). Not carried (its next turn starts over, as before): a conversation whose
        new home already holds turns of it or a turn in flight. O(conversations x salts +
        their tokens)."""
        old = self.engines[lost]
        cids = {cid for cid, target in report.rehomed if target is not None}
        for salt, _ in old.prompt_renderer.stores.conversation_stores():
            for cid in cids:
                home = self.router.home(cid, salt=salt)
                if home is None or home == lost:
                    continue
                history = old.export_conversation(cid, cache_salt=salt)
                if history is None:
                    continue
                carried = self.engines[home].import_conversation(cid, history, cache_salt=salt)
                if not carried:
                    _log.warning(
                        "conversation %r: history not carried from %s to %s (it holds the "
                        "conversation already); its next turn starts there as a first turn",
                        cid,
                        lost,
                        home,
                    )
                old.end_conversation(cid, cache_salt=salt)

    def mark_up(self, replica: str) -> None:
        """``replica`` is back: it rejoins empty (a fresh planner on its engine: no trees, no
        conversations, whatever it held before it went down)."""
        rid = ReplicaId(replica)
        if self.router.replica(rid).healthy:
            return
        if not self._shared_planners:  # shared ones stay (their trees were emptied)
            self.engines[rid].set_planner(self._fresh_planner())
        self.router.mark_up(rid)

    def down(self) -> list[ReplicaId]:
        return [r for r in self.router.replica_ids if not self.router.replica(r).healthy]

    def probe(self) -> list[ReplicaId]:
        """Send a 1-token request to every replica that is down; those that answer rejoin
        (:meth:`mark_up`). Returns them. Cost: one tiny request per replica down (its
        connect timeout when still unreachable)."""
        back: list[ReplicaId] = []
        for rid in self.down():
            engine = self.engines[rid]
            ids = tuple(engine.tokenizer.encode("ping"))[:4] or (0,)
            try:
                engine.submit(TokensRequest(ids, sampling=SamplingRequest(max_tokens=1))).result()
            except Exception:  # any failure: still down
                continue
            self.mark_up(rid)
            back.append(rid)
        return back

    def _maybe_probe(self) -> None:
        with self._lock:
            due = self._clock() - self._last_probe >= self._probe_interval_s
            if self._probing or not due or not self.down():
                return
            self._probing = True
            self._last_probe = self._clock()
        threading.Thread(target=self._probe_in_background, daemon=True).start()

    def _probe_in_background(self) -> None:
        try:
            self.probe()
        finally:
            with self._lock:
                self._probing = False
                self._last_probe = self._clock()

    def close(self) -> None:
        try:
            self.router.close()  # withdraws this worker's load from the shared state
        except Exception as exc:  # a store that is gone must not keep the engines open
            _log.warning("routing state not withdrawn on close: %r", exc)
        for engine in self.engines.values():
            engine.close()


class RoutedRequest:
    """One request over a :class:`ReplicaSet`, as its :class:`RequestHandle` sees it: an
    outer :class:`RequestState` (done once the request ended on its last replica) and turn
    hooks that commit or give up the current attempt. An attempt that fails with
    ``ServerUnavailable`` marks its replica down; when no token had come back it is retried
    on another replica (at most once per replica), so the caller sees one request.

    Invariants: exactly one attempt is current after the start; an attempt is settled
    (committed or given up, its decision finished) exactly once; the outer state's ``done``
    is set exactly once, after the last attempt ended."""

    def __init__(
        self,
        replicas: ReplicaSet,
        request: EngineRequest,
        request_id: str,
    ) -> None:
        self._replicas = replicas
        self._request = request
        self._lock = threading.Lock()
        self._attempt: Attempt | None = None  # owner: _lock
        self._aborted = False  # owner: _lock
        self._ended = False  # owner: _lock (committed or given up)
        self.retries = 0  # owner: _lock
        self.state = RequestState(request_id)
        self._on_delta: OnDelta | None = None
        self._on_done: OnDone | None = None
        self._flight: InFlight | None = None

    # ---- the handle's side ----

    def start(self, on_delta: OnDelta, on_done: OnDone) -> InFlight:
        """Route and start the first attempt; a replica that refuses it at the start
        (``ServerUnavailable``) is marked down and the next one tried, once per replica.
        Other errors propagate: nothing started."""
        self._on_delta, self._on_done = on_delta, on_done
        while True:
            try:
                attempt = self._replicas.start_attempt(
                    self._request, self._attempt_done, self._delta
                )
                break
            except ServerUnavailable:  # its replica is marked down: try another, once each
                if self.retries >= len(self._replicas.engines) - 1:
                    raise
                self.retries += 1
        assert attempt.flight is not None
        first = attempt.flight
        self.state.submitted_at = first.state.submitted_at
        self._flight = InFlight(
            self.state, first.sampling, first.token_ids, first.cache_salt, turn=self
        )
        self._make_current(attempt)
        return self._flight

    def abort(self, request_id: str) -> None:
        """Stop the current attempt (a retry that starts later is stopped as it starts)."""
        del request_id
        with self._lock:
            self._aborted = True
            attempt = self._attempt
        if attempt is not None:
            self._replicas.abort_attempt(attempt)

    def commit(self, flight: InFlight) -> GenerationResult:
        """The request finished: commit its attempt on its replica (TurnHooks)."""
        del flight
        with self._lock:
            attempt, self._ended = self._attempt, True
            retries = self.retries
        assert attempt is not None
        result = self._replicas.finish_attempt(attempt)
        report = replace(
            result.report,
            replica=attempt.replica,
            rehomed=attempt.decision.rehomed,
            retries=retries,
        )
        return replace(result, report=report)

    def give_up(self) -> None:
        """Nothing is committed (TurnHooks); idempotent with :meth:`commit`'s failure path."""
        with self._lock:
            if self._ended:
                return
            attempt, self._ended = self._attempt, True
        if attempt is not None:
            self._replicas.give_up_attempt(attempt)

    # ---- the replicas' side ----

    def _delta(self, out: StepOutput, now: float) -> None:
        if self._on_delta is not None:
            self._on_delta(out, now)

    def _make_current(self, attempt: Attempt) -> None:
        with self._lock:
            self._attempt = attempt
            early = attempt.done_early
            stop = self._aborted
            ended = self._ended  # given up while this retry started: settle it here
        if stop or ended:
            self._replicas.abort_attempt(attempt)
        if ended:
            self._replicas.give_up_attempt(attempt)
        if early:
            self._attempt_done(attempt)

    def _attempt_done(self, attempt: Attempt) -> None:
        with self._lock:
            if attempt is not self._attempt:
                attempt.done_early = True  # its start has not returned yet
                return
            if attempt.handled:
                return
            attempt.handled = True
            flight = attempt.flight
            assert flight is not None
            error = flight.state.error
            lost = isinstance(error, ServerUnavailable)
            retry = (
                lost
                and not flight.state.token_ids
                and not self._aborted
                and not self._ended
                and self.retries < len(self._replicas.engines) - 1
            )
            if retry:
                self.retries += 1
        if lost:
            _log.warning(
                "replica %s lost (%s); request %s %s",
                attempt.replica,
                type(error).__name__,
                self.state.request_id,
                "retried elsewhere" if retry else "not retried",
            )
            self._replicas.mark_down(attempt.replica)
        if retry:
            threading.Thread(target=self._retry, args=(attempt,), daemon=True).start()
            return
        self._end(error)

    def _retry(self, failed: Attempt) -> None:
        self._replicas.give_up_attempt(failed)
        try:
            attempt = self._replicas.start_attempt(self._request, self._attempt_done, self._delta)
        except BaseException as exc:  # no healthy replica left, or it failed to start
            failed_flight = failed.flight
            error = failed_flight.state.error if failed_flight is not None else None
            _log.warning(
                "request %s: retry after %s failed: %r", self.state.request_id, failed.replica, exc
            )
            if error is not None:
                error.add_note(f"retried on another replica, which failed to start: {exc!r}")
            self._end(error if error is not None else exc)
            return
        assert attempt.flight is not None and self._flight is not None
        self._flight.token_ids = attempt.flight.token_ids
        self._make_current(attempt)

    def _end(self, error: BaseException | None) -> None:
        state = self.state
        state.error = error
        state.finished_at = time.monotonic()
        state._finish()
        if self._on_done is not None:
            self._on_done()
