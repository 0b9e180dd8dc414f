"""Speculative retrieval pipelining: prefill the early top-k while the search goes on (RAGCache
§5.3).

A vector search that costs as much as the prefill delays the first token by its whole length.
Split into stages (IVF: a growing share of the probed clusters), it yields a partial top-k after
each stage, and that is often already the final one. The pipeline starts a *speculative
prefill* of the partial top-k while the search continues; when a later stage changes the top-k
*set*, the running speculation is aborted and one for the new set starts; when the search ends,
the final request is served, and if its chunk set is the last speculation's, its prompt is the
speculation's prompt and vLLM's prefix cache serves the prefill already done.

This module is framework-free and engine-free (the engine is above this package):

- :class:`IVFStagedSearch`: a faiss IVF index searched in stages (the ``nprobe`` nearest
  clusters, a slice more per stage, each stage searching only its new clusters and merging), or
  any iterable of top-k lists (a retriever that can yield partial results) fed to the pipeline;
- :class:`SpeculativePipeline`: the decisions (restart on a changed set, no restart on a stable
  one, no speculation while the engine is busy), the timing and the
  :class:`PipelineReport`, over a :class:`PrefillTarget` (the engine side is
  :class:`craft_rag.engine.pipelining.SpeculativePrefill`; tests use fakes).

Why compare *sets*: CRAFT orders the chunks itself (the planner), so the retriever's order
inside a set does not matter; a set that is stable across stages keeps the plan (and order) of
its speculation, and the final request serves that same plan.

Why abort a stale speculation even when the queue gate forbids starting a new one: under load a
prefill of chunks the final answer will not use only delays other requests (RAGCache keeps it
running; it may become right again, which is rare: stages only add clusters).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_STAGES",
    "IVFStagedSearch",
    "PipelineReport",
    "PipelinedOutcome",
    "PrefillTarget",
    "Speculation",
    "SpeculativePipeline",
    "Stage",
    "check_max_in_flight",
]

DEFAULT_STAGES = 4
"""Stages of an IVF search (RAGCache's Figure 13 uses four)."""

DEFAULT_MAX_IN_FLIGHT = 1
"""Speculate only while the engine has at most this many other requests in flight."""

C = TypeVar("C")  # a retrieved item (a chunk)
C_contra = TypeVar("C_contra", contravariant=True)
R_co = TypeVar("R_co", covariant=True)
S = TypeVar("S", bound="Speculation")
R = TypeVar("R")  # the final request's result


@dataclass(frozen=True, slots=True)
class Stage:
    """One stage of a staged search: the top-k after it (best first; ``ids`` of the index,
    ``scores`` the index's metric), how many clusters were searched so far, and whether it is
    the last stage (then ``ids`` is the final top-k)."""

    number: int
    ids: tuple[int, ...]
    scores: tuple[float, ...]
    clusters: int
    final: bool


class IVFStagedSearch:
    """A faiss IVF index (``IndexIVF*``: flat, PQ, SQ...) searched in ``stages`` stages.

    The query's ``nprobe`` nearest clusters (``nprobe``: the index's own unless given) are split
    into ``stages`` consecutive slices, nearest first; stage ``i`` searches only its slice
    (``search_preassigned``) and merges it into the running top-k, so the whole staged search
    costs one ordinary search plus one small merge per stage, and the last stage's top-k is
    exactly ``index.search`` with that ``nprobe`` (ties aside). The index is read, never changed
    (not even its ``nprobe``), so one index serves concurrent searches as faiss allows.

    ``ValueError`` for an index that is not an IVF index (the fix: build one with
    ``faiss.IndexIVFFlat``/``index_factory("IVF...")``) or bad ``stages``/``nprobe``.
    """

    __slots__ = ("_index", "_inner_product", "nprobe", "stages")

    def __init__(self, index: Any, *, stages: int = DEFAULT_STAGES, nprobe: int | None = None):
        import faiss  # lazy: the core does not need faiss

        ivf: Any = index if isinstance(index, faiss.IndexIVF) else None
        if ivf is None and isinstance(index, faiss.Index):
            ivf = faiss.downcast_index(index)  # a base-class proxy of an IVF index
        if not isinstance(ivf, faiss.IndexIVF):
            msg = (
                f"staged search needs a faiss IVF index (IndexIVFFlat, index_factory('IVF...')) "
                f"searched directly, got {type(index).__name__}; for another retriever, pass "
                "its partial results as an iterable of top-k lists"
            )
            raise ValueError(msg)
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            msg = f"stages must be an int >= 1, got {stages!r}"
            raise ValueError(msg)
        probe = ivf.nprobe if nprobe is None else nprobe
        if isinstance(probe, bool) or not isinstance(probe, int) or not 1 <= probe <= ivf.nlist:
            msg = f"nprobe must be an int in [1, nlist={ivf.nlist}], got {probe!r}"
            raise ValueError(msg)
        self._index = ivf
        self._inner_product = ivf.metric_type == faiss.METRIC_INNER_PRODUCT
        self.nprobe = probe
        self.stages = min(stages, probe)  # a stage searches at least one cluster

    @property
    def index(self) -> Any:
        return self._index

    def search(self, query: Any, k: int) -> Iterator[Stage]:
        """Yield the top-``k`` after each stage (one query vector, shape ``(d,)`` or
        ``(1, d)``). Lazy: a stage's search runs when the next item is asked for, so a
        consumer acts on stage ``i`` while stage ``i + 1`` has not started. Cost: one
        quantizer search, then per stage ``search_preassigned`` over its clusters plus an
        O(k log k) merge."""
        import numpy as np

        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            msg = f"k must be an int >= 1, got {k!r}"
            raise ValueError(msg)
        ivf: Any = self._index  # faiss's stubs type the C++ signature, not the wrapper
        x = np.ascontiguousarray(np.asarray(query, dtype="float32").reshape(1, -1))
        if x.shape[1] != ivf.d:
            msg = f"query has dimension {x.shape[1]}, the index {ivf.d}"
            raise ValueError(msg)
        coarse_d, coarse_i = ivf.quantizer.search(x, self.nprobe)
        best: dict[int, float] = {}
        bounds = [round(self.nprobe * s / self.stages) for s in range(self.stages + 1)]
        # search_preassigned takes exactly index.nprobe probes per query: a stage's clusters
        # in pieces of that width, the rest of a piece -1 (skipped by faiss); the index's
        # nprobe is never changed.
        width = ivf.nprobe
        for number in range(1, self.stages + 1):
            lo, hi = bounds[number - 1], bounds[number]
            for start in range(lo, hi, width):
                end = min(start + width, hi)
                probes = np.full((1, width), -1, dtype="int64")
                dists = np.zeros((1, width), dtype="float32")
                probes[0, : end - start] = coarse_i[0, start:end]
                dists[0, : end - start] = coarse_d[0, start:end]
                dist, ids = ivf.search_preassigned(x, k, probes, dists)
                self._merge(best, dist[0], ids[0], k)
            yield Stage(
                number=number,
                ids=tuple(best),
                scores=tuple(best.values()),
                clusters=hi,
                final=number == self.stages,
            )

    def _merge(self, best: dict[int, float], dist: Any, ids: Any, k: int) -> None:
        """Merge one search's results into ``best`` (kept ranked, best first, at most k)."""
        for d, i in zip(dist.tolist(), ids.tolist(), strict=True):
            if i >= 0:
                best[int(i)] = float(d)
        ranked = sorted(best.items(), key=lambda kv: -kv[1] if self._inner_product else kv[1])
        del ranked[k:]
        best.clear()
        best.update(ranked)


def check_max_in_flight(value: object) -> int:
    """``value`` if it is a valid queue gate (an int >= 0), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        msg = f"max_in_flight must be an int >= 0 (0: speculate only when idle), got {value!r}"
        raise ValueError(msg)
    return value


class Speculation(Protocol):
    """One speculative prefill (made by a :class:`PrefillTarget`)."""

    def abort(self) -> None:
        """Stop it if the engine still serves it and give its turn up: nothing committed.
        Idempotent."""
        ...

    def wasted_tokens(self, final_prompt: Sequence[int]) -> int:
        """After :meth:`abort`: the prompt tokens it computed that ``final_prompt`` does not
        reuse."""
        ...


class PrefillTarget(Protocol[C_contra, S, R_co]):
    """What the pipeline drives: speculative prefills and the final request."""

    def speculate(self, chunks: Sequence[C_contra]) -> S:
        """Start a prefill-only request for ``chunks`` (CRAFT-ordered by the planner)."""
        ...

    def serve(
        self, chunks: Sequence[C_contra], speculation: S | None
    ) -> tuple[R_co, Sequence[int]]:
        """Serve the final request for ``chunks``; ``speculation`` (its set is the final set)
        is ended by this call, its plan and order reused. Returns the result and the final
        prompt's token ids."""
        ...

    def in_flight(self) -> int:
        """Requests the engine has in flight (waiting or running), every one counted."""
        ...


@dataclass(frozen=True, slots=True)
class PipelineReport:
    """What one pipelined request did.

    ``stages``: partial results seen; ``speculations``: speculative prefills started;
    ``restarts``: started ones aborted because the set changed; ``gated``: changes not
    speculated on because the engine was busy (more than ``max_in_flight`` other requests);
    ``reused``: the final request's set was the last speculation's (its prefill was reused);
    ``wasted_tokens``: prompt tokens speculative prefills computed that the final prompt does
    not reuse (an upper bound for one aborted before its first token: its whole uncached
    prompt); ``search_s``: time spent in the staged search (drawing stages from the
    iterable); ``non_overlapped_search_s``: search time not overlapped with a prefill of the
    final set (RAGCache's T1: the search before the kept speculation started; ``search_s``
    when the final set was never speculated on, as without pipelining); ``speculate_s``: time
    this thread spent aborting and starting speculations (plan, render, submit) between
    stages."""

    stages: int
    speculations: int
    restarts: int
    gated: int
    reused: bool
    wasted_tokens: int
    search_s: float
    non_overlapped_search_s: float
    speculate_s: float


@dataclass(frozen=True, slots=True)
class PipelinedOutcome(Generic[C, R]):
    """The final request's result, its chunks (the final top-k, retriever order) and the
    pipeline's report."""

    result: R
    chunks: tuple[C, ...]
    report: PipelineReport


@dataclass(slots=True)
class _Running(Generic[S]):
    keys: frozenset[Hashable]
    speculation: S
    search_s: float  # the search time before it started


class SpeculativePipeline(Generic[C, S, R]):
    """Drive one request's staged search and its speculative prefills.

    Per stage: if the top-k *set* differs from the running speculation's, that speculation is
    cancelled (nothing committed) and, when the engine has at most ``max_in_flight`` other
    requests in flight, a new one is started for the stage's set; a stage with the running
    set changes nothing. The last stage is never speculated on (its set goes straight to the
    final request, which reuses a running speculation of the same set). ``enabled=False``:
    search, then serve (the baseline; the report still times the search).

    Not thread-safe: one :meth:`run` at a time per instance (the target may be shared).
    """

    def __init__(
        self,
        target: PrefillTarget[C, S, R],
        *,
        key: Callable[[C], Hashable],
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        enabled: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        check_max_in_flight(max_in_flight)
        self._target = target
        self._key = key
        self.max_in_flight = max_in_flight
        self.enabled = enabled
        self._clock = clock

    def run(
        self, stages: Iterable[Sequence[C]], *, total: int | None = None
    ) -> PipelinedOutcome[C, R]:
        """Consume ``stages`` (top-k lists, the last one final; consuming the iterable runs the
        search), speculating as described, then serve the final request. ``total``: the number
        of stages when known, so the last one is not speculated on (an :class:`IVFStagedSearch`
        knows it); unknown, a speculation started on the last stage is simply reused.
        ``ValueError`` (after aborting any speculation) when ``stages`` yields nothing; an
        error from the search or the target aborts every speculation and propagates. Cost:
        the search, plus one plan and render per speculation."""
        clock = self._clock
        running: _Running[S] | None = None
        dropped: list[S] = []
        count = speculations = gated = 0
        search_s = speculate_s = 0.0  # this thread's time in the search / starting speculations
        final: tuple[C, ...] | None = None
        iterator = iter(stages)
        try:
            while True:
                before = clock()
                stage = next(iterator, None)
                search_s += clock() - before
                if stage is None:
                    break
                count += 1
                final = tuple(stage)
                keys = frozenset(self._key(c) for c in final)
                last = total is not None and count >= total
                if not self.enabled or last or (running is not None and running.keys == keys):
                    continue
                before = clock()
                if running is not None:  # the set changed: the speculation is wrong
                    running.speculation.abort()
                    dropped.append(running.speculation)
                    running = None
                # Ours were aborted above (synchronously): every request counted is another's.
                if final and self._target.in_flight() > self.max_in_flight:
                    gated += 1
                elif final:
                    running = _Running(keys, self._target.speculate(final), search_s)
                    speculations += 1
                speculate_s += clock() - before
            if final is None:
                msg = "the staged search yielded no stage; a retriever must yield a top-k"
                raise ValueError(msg)
            final_keys = frozenset(self._key(c) for c in final)
            reused = running is not None and running.keys == final_keys
            if running is not None and not reused:
                running.speculation.abort()
                dropped.append(running.speculation)
            kept = running.speculation if reused and running is not None else None
            result, prompt = self._target.serve(final, kept)
        except BaseException:
            for spec in (*dropped, *((running.speculation,) if running is not None else ())):
                spec.abort()
            raise
        wasted = sum(spec.wasted_tokens(prompt) for spec in dropped)
        non_overlapped = running.search_s if kept is not None and running else search_s
        return PipelinedOutcome(
            result=result,
            chunks=final,
            report=PipelineReport(
                stages=count,
                speculations=speculations,
                restarts=len(dropped),
                gated=gated,
                reused=kept is not None,
                wasted_tokens=wasted,
                search_s=search_s,
                non_overlapped_search_s=non_overlapped,
                speculate_s=speculate_s,
            ),
        )
