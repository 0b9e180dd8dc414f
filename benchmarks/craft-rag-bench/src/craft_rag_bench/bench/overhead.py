"""Planner overhead: plan+commit latency and memory of CA-Table + CP-Tree at scale.

Requests draw k chunks from a universe of ``distinct`` chunk ids with a Zipf-like skew (so
chunks repeat and the tree grows real paths) until every id has been seen at least once in
aggregate (``distinct`` new ids are introduced round-robin); latency is timed per request with
``perf_counter_ns`` around ``plan`` + ``commit``; memory is traced with ``tracemalloc`` in a
separate identical run (tracing slows Python down, so it never overlaps the timing run).

Issue 16: the first ``warmup`` requests are untimed; then ``gc.freeze()`` moves everything
built so far out of the collector's generations (undone at the end), as a long-running server
would after start-up. Each request is timed twice: wall clock (what a caller waits, including
being descheduled on a shared machine) and this thread's CPU time (what the planner costs,
garbage collection included). ``replay_us_p50``/``replay_us_p99`` are plan+commit as
:func:`craft_rag.replay.replay` sees them inside a long replay (prompt rendering and the cache
simulator allocate between the calls, so collector pauses land where they would in serving),
over the first ``replay_requests`` requests with the hashing tokenizer (a whole RAG turn:
plan, prompt rendering, commit; the simulated cache lookup excluded), the objects built before
it frozen too when ``freeze_gc``. ``replay_plan_commit_us_*`` time only the planner's ``plan``
and ``commit`` calls inside that same replay (wall, summed per request; the rendering's
allocations still trigger the collector pauses that land in them). ``load_start`` /
``load_end`` are the 1-minute load averages around the timing run (on a shared machine the
wall-clock tail is descheduling; thread CPU time is the planner's own cost).
"""

from __future__ import annotations

import gc
import os
import random
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from craft_rag.chunk import Chunk
from craft_rag.metrics import percentile
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.types import ChunkKey


@dataclass(frozen=True, slots=True)
class OverheadResult:
    policy: str
    k: int
    window: int | None
    distinct_chunks_seen: int
    requests: int
    plan_commit_us_p50: float
    plan_commit_us_p99: float
    table_chunks: int
    tree_nodes: int
    state_mib: float | None
    cpu_us_p50: float | None = None
    cpu_us_p99: float | None = None
    replay_us_p50: float | None = None
    replay_us_p99: float | None = None
    replay_plan_commit_us_p50: float | None = None
    replay_plan_commit_us_p99: float | None = None
    replay_requests: int = 0
    gc_frozen: bool = False
    load_start: float | None = None
    load_end: float | None = None

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def _requests(distinct: int, k: int, seed: int) -> list[list[Chunk]]:
    """Enough requests that all ``distinct`` ids appear: half of each request is fresh ids,
    half is drawn from a hot set with a skew (popular chunks recur)."""
    rng = random.Random(seed)
    chunks = [Chunk(key=ChunkKey(f"doc-{i}:0"), text="", num_tokens=128) for i in range(distinct)]
    fresh_per_request = max(1, k // 2)
    n_requests = -(-distinct // fresh_per_request)
    hot = max(k * 4, distinct // 1000)
    out: list[list[Chunk]] = []
    nxt = 0
    for _ in range(n_requests):
        picked: dict[ChunkKey, Chunk] = {}
        for _ in range(fresh_per_request):
            c = chunks[nxt % distinct]
            nxt += 1
            picked[c.key] = c
        while len(picked) < k:
            c = chunks[min(hot - 1, int(rng.paretovariate(1.2)) - 1)]
            picked[c.key] = c
            if len(picked) < k and rng.random() < 0.2:
                c = chunks[rng.randrange(distinct)]
                picked[c.key] = c
        out.append(list(picked.values()))
    return out


def _run(
    planner: CraftPlanner, requests: list[list[Chunk]], timed: bool
) -> tuple[list[float], list[float]]:
    """Plan+commit every request; with ``timed``, (wall µs, thread CPU µs) per request."""
    wall: list[float] = []
    cpu: list[float] = []
    perf, thread = time.perf_counter_ns, time.thread_time_ns
    for request in requests:
        t0, c0 = perf(), thread()
        plan = planner.plan(request)
        planner.commit(plan, prefix_tokens=40)
        if timed:
            c1, t1 = thread(), perf()
            wall.append((t1 - t0) / 1000)
            cpu.append((c1 - c0) / 1000)
    return wall, cpu


def _replay_times(
    policy: str, window: int | None, requests: list[list[Chunk]], freeze: bool
) -> tuple[float, float, float, float]:
    """p50/p99 of the whole turn and of plan+commit alone inside
    :func:`craft_rag.replay.replay` (hashing tokenizer). With ``freeze``, what exists before
    the replay starts (the trace, the timing run's requests) is ``gc.freeze()``-n first, as a
    server would after start-up: the collector's pauses inside the replay are then those of
    the replay's own objects. Plan and commit are timed by wrapping the two
    :class:`CraftPlanner` methods for the duration of the replay (~0.2 µs per call added)."""
    from craft_rag.replay import replay
    from craft_rag.tokenizer import HashingTokenizer
    from craft_rag.trace import TraceRequest

    trace = [
        TraceRequest(id=str(i), query="q", chunks=tuple(
            Chunk(key=c.key, text=c.key, num_tokens=None) for c in request
        ))
        for i, request in enumerate(requests)
    ]
    config = PlannerConfig(policy=policy, window=window)
    plan_ns: list[int] = []
    commit_ns: list[int] = []
    original_plan, original_commit = CraftPlanner.plan, CraftPlanner.commit
    perf = time.perf_counter_ns

    def timed(method: Callable[..., Any], sink: list[int]) -> Callable[..., Any]:
        def call(self: CraftPlanner, *args: Any, **kwargs: Any) -> Any:
            t0 = perf()
            try:
                return method(self, *args, **kwargs)
            finally:
                sink.append(perf() - t0)
        return call

    if freeze:
        gc.collect()
        gc.freeze()
    CraftPlanner.plan = timed(original_plan, plan_ns)  # type: ignore[method-assign]
    CraftPlanner.commit = timed(original_commit, commit_ns)  # type: ignore[method-assign]
    try:
        result = replay(trace, config, HashingTokenizer())
    finally:
        CraftPlanner.plan, CraftPlanner.commit = original_plan, original_commit  # type: ignore[method-assign]
        if freeze:
            gc.unfreeze()
    if len(plan_ns) != len(commit_ns) or len(plan_ns) != len(trace):
        msg = f"expected one plan and one commit per request, got {len(plan_ns)} / {len(commit_ns)}"
        raise RuntimeError(msg)
    both = [(p + c) / 1000 for p, c in zip(plan_ns, commit_ns, strict=True)]
    return (
        result.planner_us_p50,
        result.planner_us_p99,
        percentile(both, 50),
        percentile(both, 99),
    )


def measure_overhead(
    *,
    policy: str = "tree",
    k: int = 5,
    window: int | None = 1000,
    distinct: int = 1_000_000,
    seed: int = 0,
    trace_memory: bool = True,
    warmup: int = 1000,
    freeze_gc: bool = True,
    replay_requests: int = 5_000,
) -> OverheadResult:
    """Time plan+commit over a stream that introduces ``distinct`` chunks (after ``warmup``
    untimed requests and, with ``freeze_gc``, ``gc.freeze()``); optionally trace the memory of
    the planner's state in a second run; time ``replay_requests`` requests inside a replay."""
    requests = _requests(distinct, k, seed)
    planner = CraftPlanner(PlannerConfig(policy=policy, window=window))
    warm = min(warmup, len(requests) // 10)
    _run(planner, requests[:warm], timed=False)
    frozen = freeze_gc and hasattr(gc, "freeze")
    if frozen:
        gc.collect()
        gc.freeze()
    load_start = _load()
    try:
        times, cpu = _run(planner, requests[warm:], timed=True)
    finally:
        if frozen:
            gc.unfreeze()
    load_end = _load()
    replay_p50 = replay_p99 = alone_p50 = alone_p99 = None
    replayed = min(replay_requests, len(requests))
    if replayed:
        replay_p50, replay_p99, alone_p50, alone_p99 = _replay_times(
            policy, window, requests[:replayed], frozen
        )
    mib: float | None = None
    if trace_memory:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        traced = CraftPlanner(PlannerConfig(policy=policy, window=window))
        _run(traced, requests, timed=False)
        mib = (tracemalloc.get_traced_memory()[0] - base) / 2**20
        tracemalloc.stop()
        del traced
    return OverheadResult(
        policy=policy,
        k=k,
        window=window,
        distinct_chunks_seen=distinct,
        requests=len(requests),
        plan_commit_us_p50=percentile(times, 50),
        plan_commit_us_p99=percentile(times, 99),
        table_chunks=len(planner.access_table),
        tree_nodes=len(planner.prefix_tree),
        state_mib=mib,
        cpu_us_p50=percentile(cpu, 50),
        cpu_us_p99=percentile(cpu, 99),
        replay_us_p50=replay_p50,
        replay_us_p99=replay_p99,
        replay_plan_commit_us_p50=alone_p50,
        replay_plan_commit_us_p99=alone_p99,
        replay_requests=replayed,
        gc_frozen=frozen,
        load_start=load_start,
        load_end=load_end,
    )


def _load() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None
