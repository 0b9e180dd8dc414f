"""Speculative retrieval pipelining over a :class:`~craft_rag.engine.CraftEngine` (RAGCache
§5.3; the decisions and the staged IVF search are :mod:`craft_rag.scheduling.pipelining`).

A speculation is a RAG request with the stage's chunks and the real question, served with
``max_tokens=1`` (prefill only: the one token is the prefill's own output, never shown), from a
plan this module makes with the request's planner and hands in with ``plan=``:

- **aborted** (the set changed): the request is aborted, which gives its turn up (the engine
  *releases* a caller's plan), and the plan is then aborted in the planner: nothing is
  committed, the CA-Table, CP-Tree and conversations are as before. The KV blocks the prefill
  computed stay in vLLM's prefix cache like any other cached blocks (the CP-Tree does not
  claim them: it predicts nothing it was not told).
- **kept** (the final set is its set): the final request waits for the speculation's prefill to
  end (its one token), ends it without a commit (the plan is released) and serves *the same
  plan* with the caller's sampling, so the prompt is token for token the speculation's and vLLM
  serves its prefill from the prefix cache; that request is committed as any other. The
  order is the plan's, made at the stage where the set first appeared: where the planner has
  no reason to prefer an order it keeps the retriever's order *of that stage*, so the prompt
  equals the non-pipelined one when the retriever's order inside the set did not change.

Only single requests (no conversation) are pipelined: a conversation turn's prompt depends on
the reply budget (old turns dropped to fit), which a prefill-only speculation does not share.
Off by default: nothing in the engine speculates unless this class is used.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from craft_rag.chunk import Chunk
from craft_rag.engine.engine import CraftEngine
from craft_rag.engine.requests import RequestHandle
from craft_rag.engine.results import GenerationResult, RagRequest, SamplingRequest
from craft_rag.metrics import lcp
from craft_rag.planner import CraftPlanner, Plan
from craft_rag.scheduling.pipelining import (
    DEFAULT_MAX_IN_FLIGHT,
    PipelinedOutcome,
    PrefillTarget,
    SpeculativePipeline,
    check_max_in_flight,
)

__all__ = ["EngineSpeculation", "SpeculativePrefill"]

R = TypeVar("R")  # what the final step returns: a GenerationResult (run) or a Plan (prepare)


@dataclass(slots=True, eq=False)
class EngineSpeculation:
    """One speculative prefill: its plan (made by ``planner``, served with ``plan=``) and the
    engine request. Owner: the :class:`SpeculativePrefill` run that started it."""

    planner: CraftPlanner
    plan: Plan
    handle: RequestHandle
    aborted: bool = field(default=False)

    def abort(self) -> None:
        """Stop the request (its turn is given up: the plan released, nothing committed) and
        abort the plan in the planner. Idempotent. O(1)."""
        if self.aborted:
            return
        self.aborted = True
        self.handle.abort()
        self.planner.abort(self.plan)

    def wasted_tokens(self, final_prompt: Sequence[int]) -> int:
        """Prompt tokens past both the plan's predicted cached prefix and the prefix shared
        with ``final_prompt``: what this prefill computed in vain (an upper bound when it was
        aborted before its prefill ended). O(prompt tokens)."""
        prompt = self.handle.prompt_token_ids
        reused = max(self.plan.matched_tokens or 0, lcp(prompt, final_prompt))
        return max(0, len(prompt) - reused)


class _EngineTarget:
    """The :class:`~craft_rag.scheduling.pipelining.PrefillTarget` of one pipelined request."""

    __slots__ = ("_cache_salt", "_engine", "_question", "_sampling")

    def __init__(
        self,
        engine: CraftEngine,
        question: str,
        sampling: SamplingRequest,
        cache_salt: str | None,
    ) -> None:
        self._engine = engine
        self._question = question
        self._sampling = sampling
        self._cache_salt = cache_salt

    def speculate(self, chunks: Sequence[Chunk]) -> EngineSpeculation:
        planner = self._engine.planner_for(self._cache_salt)
        plan = planner.plan(list(chunks))
        try:
            handle = self._engine.submit(self._request(chunks, plan, prefill_only=True))
        except BaseException:
            planner.abort(plan)
            raise
        return EngineSpeculation(planner, plan, handle)

    def serve(
        self, chunks: Sequence[Chunk], speculation: EngineSpeculation | None
    ) -> tuple[GenerationResult, Sequence[int]]:
        plan = None
        if speculation is not None:
            speculation.handle.wait()  # its prefill: the final request then hits it whole
            speculation.aborted = True
            speculation.handle.abort()  # given up: the plan is released, not committed
            plan = speculation.plan
        try:
            result = self._engine.submit(self._request(chunks, plan, prefill_only=False)).result()
        except BaseException:
            if speculation is not None:
                speculation.planner.abort(speculation.plan)
            raise
        return result, result.prompt_token_ids

    def in_flight(self) -> int:
        return self._engine.requests_in_flight

    def _request(
        self, chunks: Sequence[Chunk], plan: Plan | None, *, prefill_only: bool
    ) -> RagRequest:
        sampling = replace(self._sampling, max_tokens=1) if prefill_only else self._sampling
        return RagRequest(
            chunks=tuple(chunks),
            question=self._question,
            cache_salt=self._cache_salt,
            plan=plan,
            sampling=sampling,
        )


class _PlanTarget:
    """An :class:`_EngineTarget` whose final request is the caller's: ``serve`` returns the
    final set's pending plan (the kept speculation's, its prefill done, or a new one)."""

    __slots__ = ("_inner", "_planner")

    def __init__(self, inner: _EngineTarget, planner: CraftPlanner) -> None:
        self._inner = inner
        self._planner = planner

    def speculate(self, chunks: Sequence[Chunk]) -> EngineSpeculation:
        return self._inner.speculate(chunks)

    def in_flight(self) -> int:
        return self._inner.in_flight()

    def serve(
        self, chunks: Sequence[Chunk], speculation: EngineSpeculation | None
    ) -> tuple[Plan, Sequence[int]]:
        if speculation is None:
            return self._planner.plan(list(chunks)), ()
        speculation.handle.wait()
        speculation.aborted = True
        speculation.handle.abort()  # given up: the plan is released, pending again
        return speculation.plan, speculation.handle.prompt_token_ids


class SpeculativePrefill:
    """Serve RAG requests whose retrieval runs in stages, prefilling the partial top-k while
    the search goes on (see the module docstring).

    ``max_in_flight``: speculate only while the engine has at most this many other requests
    (waiting or running); busier, a changed top-k only aborts the stale speculation.
    ``enabled=False`` searches, then serves (the baseline, with the same report).
    Thread-safe as the engine is: each :meth:`run` keeps its own state.
    """

    def __init__(
        self,
        engine: CraftEngine,
        *,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        enabled: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not isinstance(engine, CraftEngine):
            msg = f"engine must be a craft_rag.engine.CraftEngine, got {type(engine).__name__}"
            raise ValueError(msg)
        check_max_in_flight(max_in_flight)  # fails here, not at the first request
        try:
            engine.requests_in_flight  # noqa: B018 - the queue gate's signal must exist
        except AttributeError as exc:  # e.g. a RoutedEngine (server=[...]): no one queue
            msg = (
                f"speculative pipelining needs one engine with a request queue; "
                f"{type(engine).__name__} has none (serve through a single server or in-process)"
            )
            raise ValueError(msg) from exc
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.enabled = enabled
        self._clock = clock

    def run(
        self,
        stages: Iterable[Sequence[Chunk]],
        question: str,
        *,
        total: int | None = None,
        cache_salt: str | None = None,
        sampling: SamplingRequest | None = None,
    ) -> PipelinedOutcome[Chunk, GenerationResult]:
        """Consume ``stages`` (top-k chunk lists, best first; the last is the final top-k),
        speculating on each changed set, then serve the final request with ``sampling``
        (default ``SamplingRequest()``) and return its result, chunks and
        :class:`~craft_rag.scheduling.pipelining.PipelineReport`. ``total``: the number of
        stages when known (the last is then not speculated on). ``ValueError`` for a bad
        question or chunks (as :meth:`CraftEngine.generate`) or no stage; any error aborts
        every speculation (nothing committed)."""
        return self._pipeline(self._engine_target(question, sampling, cache_salt), stages, total)

    def prepare(
        self,
        stages: Iterable[Sequence[Chunk]],
        question: str,
        *,
        total: int | None = None,
        cache_salt: str | None = None,
        sampling: SamplingRequest | None = None,
    ) -> PipelinedOutcome[Chunk, Plan]:
        """As :meth:`run`, but the final request is left to the caller (a framework's LLM
        step): the result is the final set's plan, made by ``engine.planner_for(cache_salt)``
        and pending (neither claimed nor committed): the kept speculation's, whose prefill
        has ended, or a new one. Serve it with ``RagRequest(..., plan=plan)`` (the same
        ``question``, so the prompt is the speculation's) or find it by its chunk keys
        (:meth:`craft_rag.CraftPlanner.reserve`); abort it in the planner if it is not
        served. ``wasted_tokens`` counts a dropped speculation's prompt past the kept one's
        shared prefix (all of it when none was kept)."""
        inner = self._engine_target(question, sampling, cache_salt)
        target = _PlanTarget(inner, self.engine.planner_for(cache_salt))
        return self._pipeline(target, stages, total)

    def _pipeline(
        self,
        target: PrefillTarget[Chunk, EngineSpeculation, R],
        stages: Iterable[Sequence[Chunk]],
        total: int | None,
    ) -> PipelinedOutcome[Chunk, R]:
        """Run ``stages`` through a new pipeline over ``target`` with this object's settings
        (what :meth:`run` and :meth:`prepare` share; they differ only in the target)."""
        pipeline = SpeculativePipeline(
            target,
            key=_chunk_key,
            max_in_flight=self.max_in_flight,
            enabled=self.enabled,
            clock=self._clock,
        )
        return pipeline.run(_checked(stages), total=total)

    def _engine_target(
        self, question: str, sampling: SamplingRequest | None, cache_salt: str | None
    ) -> _EngineTarget:
        """The speculations' target for ``question`` (``ValueError`` when it is empty)."""
        if not isinstance(question, str) or not question.strip():
            msg = "question must be a non-empty string"
            raise ValueError(msg)
        return _EngineTarget(self.engine, question, sampling or SamplingRequest(), cache_salt)


def _chunk_key(chunk: Chunk) -> str:
    return chunk.key


def _checked(stages: Iterable[Sequence[Chunk]]) -> Iterable[Sequence[Chunk]]:
    for stage in stages:
        items = tuple(stage)
        bad = [type(c).__name__ for c in items if not isinstance(c, Chunk)]
        if bad:
            msg = f"a stage must be a sequence of craft_rag.Chunk, got {bad[0]}"
            raise ValueError(msg)
        yield items
