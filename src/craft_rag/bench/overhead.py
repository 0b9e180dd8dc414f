"""Planner overhead: plan+commit latency and memory of CA-Table + CP-Tree at scale.

Requests draw k chunks from a universe of ``distinct`` chunk ids with a Zipf-like skew (so
chunks repeat and the tree grows real paths) until every id has been seen at least once in
aggregate (``distinct`` new ids are introduced round-robin); latency is timed per request with
``perf_counter_ns`` around ``plan`` + ``commit``; memory is traced with ``tracemalloc`` in a
separate identical run (tracing slows Python down, so it never overlaps the timing run).
"""

from __future__ import annotations

import random
import time
import tracemalloc
from dataclasses import asdict, dataclass

from craft_rag.chunk import Chunk
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.replay import percentile
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


def _run(planner: CraftPlanner, requests: list[list[Chunk]], timed: bool) -> list[float]:
    times: list[float] = []
    perf = time.perf_counter_ns
    for request in requests:
        t0 = perf()
        plan = planner.plan(request)
        planner.commit(plan, prefix_tokens=40)
        if timed:
            times.append((perf() - t0) / 1000)
    return times


def measure_overhead(
    *,
    policy: str = "tree",
    k: int = 5,
    window: int | None = 1000,
    distinct: int = 1_000_000,
    seed: int = 0,
    trace_memory: bool = True,
) -> OverheadResult:
    """Time plan+commit over a stream that introduces ``distinct`` chunks; optionally trace
    the memory of the planner's state in a second run."""
    requests = _requests(distinct, k, seed)
    planner = CraftPlanner(PlannerConfig(policy=policy, window=window))
    times = _run(planner, requests, timed=True)
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
    )
