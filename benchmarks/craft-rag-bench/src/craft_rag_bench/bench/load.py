"""Suite ``load`` (paper Fig. 13a): TTFT vs request rate, and throughput at an SLO.

Requests of the single-turn trace arrive as a seeded Poisson process at each rate; each arrival
calls :meth:`CraftEngine.generate` on its own thread, so vLLM batches whatever is in flight
(TTFT runs from submission and includes queueing in the engine). Each (system, rate) point
starts from an empty cache, a fresh planner and a warm-up request, and serves the same
requests. The SLO is RAGCache's: 5x the low-load TTFT, taken as the mean TTFT of no prefix
caching serving the same requests one at a time (no queueing; one SLO for every system).
Throughput at the SLO is the highest offered rate whose mean TTFT stays within it, with the
completed requests per second there.

``admission`` (:mod:`craft_rag_bench.bench.load_admission`): FCFS vs cache-aware admission side
by side, each on its own engine, on SQuAD and HotpotQA (issue 30's targets).
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from craft_rag.metrics import percentile
from craft_rag.planner import CraftPlanner
from craft_rag.trace import TraceRequest
from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.serving import SYSTEMS, BenchSystem, serve, warm_up

if TYPE_CHECKING:
    from craft_rag.engine import CraftEngine, GenerationResult

LOAD_SYSTEMS: tuple[str, ...] = ("no_cache", "prefix_cache", "craft_tree")
SLO_FACTOR = 5.0


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """``n`` arrival offsets (seconds) of a Poisson process with ``rate`` per second."""
    rng = random.Random(seed)
    t = 0.0
    out: list[float] = []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def serve_poisson(
    engine: CraftEngine,
    system: BenchSystem,
    trace: list[TraceRequest],
    arrivals: list[float],
    *,
    max_tokens: int,
) -> tuple[list[GenerationResult], float]:
    """Serve ``trace`` with request i submitted at ``arrivals[i]`` seconds; returns the
    results (input order) and the makespan from the first arrival to the last completion."""
    engine.set_planner(CraftPlanner(system.config))
    warm_up(engine)
    if not engine.reset_prefix_cache():
        msg = "could not reset the prefix cache (requests still running)"
        raise RuntimeError(msg)
    start = time.perf_counter() + 0.05
    finished: list[float] = []
    lock = threading.Lock()

    def one(i: int) -> GenerationResult:
        delay = start + arrivals[i] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        request = trace[i]
        result = engine.generate(
            request.chunks, request.query, max_tokens=max_tokens,
            read_prefix_cache=system.read_prefix_cache,
        )
        with lock:
            finished.append(time.perf_counter())
        return result

    with ThreadPoolExecutor(max_workers=max(1, len(trace))) as pool:
        results = list(pool.map(one, range(len(trace))))
    return results, max(finished) - start


def run(ctx: BenchContext) -> dict[str, Any]:
    engine = ctx.get_engine()
    sizes = ctx.sizes
    workload = ctx.workloads(["squad"])[0]
    trace = [r for r in ctx.trace(workload, sizes.load_requests) if r.conversation_id is None]
    if not trace:
        msg = "the load suite needs single-turn requests (no conversation_id) in the trace"
        raise ValueError(msg)
    points: list[dict[str, Any]] = []
    cases = [(name, rate) for name in LOAD_SYSTEMS for rate in sizes.load_rates]
    for name, rate in ctx.bar(cases, "load"):
        arrivals = poisson_arrivals(len(trace), rate, ctx.seed)
        results, makespan = serve_poisson(
            engine, SYSTEMS[name], trace, arrivals, max_tokens=sizes.ttft_max_tokens
        )
        ttfts = [r.report.ttft_ms for r in results]
        prompt = sum(r.report.prompt_tokens for r in results)
        points.append({
            "system": name,
            "rate": rate,
            "requests": len(results),
            "mean_ttft_ms": sum(ttfts) / len(ttfts),
            "p50_ttft_ms": percentile(ttfts, 50),
            "p99_ttft_ms": percentile(ttfts, 99),
            "throughput_rps": len(results) / makespan if makespan > 0 else 0.0,
            "cached_token_fraction": sum(r.report.cached_tokens for r in results) / prompt
            if prompt else 0.0,
        })
    sequential = serve(engine, SYSTEMS["no_cache"], trace, max_tokens=sizes.ttft_max_tokens,
                       desc="load/low-load", ctx=ctx)
    low_ms = sum(r.report.ttft_ms for r in sequential) / len(sequential)
    slo = SLO_FACTOR * low_ms
    at_slo: dict[str, Any] = {}
    for name in LOAD_SYSTEMS:
        ok = [p for p in points if p["system"] == name and p["mean_ttft_ms"] <= slo]
        best = max(ok, key=lambda p: p["rate"]) if ok else None
        at_slo[name] = {
            "max_rate_within_slo": best["rate"] if best else None,
            "throughput_rps": best["throughput_rps"] if best else None,
        }
    from craft_rag_bench.bench.load_admission import run_admission

    admission = run_admission(ctx)  # closes the bench's engine; the next suite restarts it
    return {
        "suite": "load",
        "workload": workload,
        "rates": list(sizes.load_rates),
        "max_tokens": sizes.ttft_max_tokens,
        "low_load_ttft_ms": low_ms,
        "slo_ms": slo,
        "points": points,
        "at_slo": at_slo,
        "admission": admission,
    }
