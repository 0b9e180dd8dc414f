"""The ``load`` suite's admission comparison: FCFS vs cache-aware admission side by side.

Issue 30 (RAGCache §5.2): under a saturating Poisson load, serving first the waiting requests
whose prompts are mostly cached should lower mean TTFT and raise the throughput at the SLO,
with p99 bounded by the reordering window. Both modes serve the same requests under CRAFT's
order (``craft_tree``: prefix caching, the CP-Tree's predicted cached tokens rank the
requests), each on its own engine, one after the other:

- ``fcfs``: the bench's own engine (default settings: vLLM's FCFS scheduler, admission off);
- ``cache_aware``: an engine with the same settings plus ``admission="cache_aware"`` (vLLM's
  priority scheduler, each request's priority its admission key; window 32), started after the
  bench's engine is closed and closed after it ran (the next suite restarts the bench's engine).

Per workload (SQuAD and HotpotQA, or the ``--trace`` file), on the ``fcfs`` engine first: the
low-load run (no prefix caching, one request at a time, as the rest of the suite) gives the
low-load TTFT, the SLO (5x it) and the service time ``s`` (wall seconds per request); the rates
are ``factor / s`` for each of ``admission_factors`` (``1`` offers requests as fast as one
engine serves uncached prompts one at a time, so ``>= 1`` saturates a CPU engine, whose batch
prefill costs about the sum of its prompts'). Both modes then serve the same seeded Poisson
arrivals at every rate, each point from an empty cache and a fresh planner after a warm-up
(:func:`craft_rag_bench.bench.load.serve_poisson`).

Compared (:func:`compare`, targets :data:`TARGETS`): per rate the mean-TTFT ratio
fcfs / cache_aware, the p99 ratio cache_aware / fcfs and whether the rate *saturates* the
engine (FCFS's mean TTFT at least :data:`SATURATION` x the low-load TTFT: requests queue);
per mode the throughput at the SLO, the offered rate at which mean TTFT reaches the SLO
(linear between the last rate within it and the first beyond; None when the grid does not
bracket it), and the ratio cache_aware / fcfs of it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from craft_rag.metrics import percentile
from craft_rag.scheduling import DEFAULT_WINDOW
from craft_rag.trace import TraceRequest
from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.load import SLO_FACTOR, poisson_arrivals, serve_poisson
from craft_rag_bench.bench.serving import SYSTEMS, serve

if TYPE_CHECKING:
    from craft_rag.engine import CraftEngine, GenerationResult

MODES: tuple[str, ...] = ("fcfs", "cache_aware")
"""Admission modes, in the order they are served (the first also runs the low-load pass)."""
WORKLOADS: tuple[str, ...] = ("squad", "hotpotqa")
SYSTEM = "craft_tree"
"""The system both modes serve (:data:`craft_rag_bench.bench.serving.SYSTEMS`)."""
SATURATION = 2.0
"""A rate saturates the engine when FCFS's mean TTFT there is at least this x the low-load
TTFT (requests wait in the queue, the regime cache-aware admission is for)."""
EngineFactory = Callable[[str], AbstractContextManager["CraftEngine"]]
"""Admission mode -> a context manager holding an engine that admits so (closed on exit when
the factory started it)."""


@dataclass(frozen=True, slots=True)
class Targets:
    """Issue 30's targets for cache-aware admission against FCFS."""

    mean_ttft_speedup: float = 1.2
    """FCFS's mean TTFT over cache_aware's at every saturating rate, at least."""
    throughput_at_slo_ratio: float = 1.15
    """cache_aware's throughput at the SLO over FCFS's, at least."""
    p99_ratio_max: float = 1.5
    """cache_aware's p99 TTFT over FCFS's at every rate, at most (the starvation bound)."""


TARGETS = Targets()


def parse_factors(text: str) -> tuple[float, ...]:
    """``--admission-factors``: comma-separated positive numbers (rates as multiples of the
    low-load service rate), or ``none`` to skip the comparison. ``ValueError`` naming the
    flag for anything else."""
    if text.strip().lower() == "none":
        return ()
    try:
        factors = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        factors = ()
    if not factors or any(not f > 0 or f == float("inf") for f in factors):
        msg = (f"--admission-factors {text!r}: give positive numbers, e.g. 0.5,1,2,4 "
               "(multiples of the low-load service rate), or none")
        raise ValueError(msg)
    return tuple(sorted(set(factors)))


def point_stats(results: Sequence[GenerationResult], makespan_s: float) -> dict[str, Any]:
    """One (mode, rate) point: mean/p50/p99 TTFT, completed requests per second over the
    makespan, cached-token fraction and mean ``admission_held_ms`` (None when no request
    reports one: admission off, or vLLM's priority order reports 0). O(n log n)."""
    ttfts = [r.report.ttft_ms for r in results]
    prompt = sum(r.report.prompt_tokens for r in results)
    held = [r.report.admission_held_ms for r in results
            if r.report.admission_held_ms is not None]
    return {
        "requests": len(results),
        "mean_ttft_ms": sum(ttfts) / len(ttfts) if ttfts else 0.0,
        "p50_ttft_ms": percentile(ttfts, 50) if ttfts else 0.0,
        "p99_ttft_ms": percentile(ttfts, 99) if ttfts else 0.0,
        "throughput_rps": len(results) / makespan_s if makespan_s > 0 else 0.0,
        "cached_token_fraction": sum(r.report.cached_tokens for r in results) / prompt
        if prompt else 0.0,
        "mean_admission_held_ms": sum(held) / len(held) if held else None,
    }


def slo_throughput(points: Sequence[Mapping[str, Any]], slo_ms: float) -> dict[str, Any]:
    """Where one mode's mean TTFT reaches the SLO, over its points sorted by rate:
    ``max_rate_within_slo`` (the highest rate of the unbroken run of rates from the lowest
    whose mean TTFT is within the SLO) with ``throughput_rps`` there, and
    ``throughput_at_slo_rps``: the offered rate at which mean TTFT crosses the SLO, linear
    between that rate and the next (None when every rate is within the SLO, the grid is too
    low, or none is). O(n log n)."""
    pts = sorted(points, key=lambda p: p["rate"])
    within = 0
    while within < len(pts) and pts[within]["mean_ttft_ms"] <= slo_ms:
        within += 1
    best = pts[within - 1] if within else None
    crossing = None
    if best is not None and within < len(pts):
        nxt = pts[within]
        lo_t, hi_t = best["mean_ttft_ms"], nxt["mean_ttft_ms"]
        frac = (slo_ms - lo_t) / (hi_t - lo_t) if hi_t > lo_t else 0.0
        crossing = best["rate"] + frac * (nxt["rate"] - best["rate"])
    return {
        "max_rate_within_slo": best["rate"] if best else None,
        "throughput_rps": best["throughput_rps"] if best else None,
        "throughput_at_slo_rps": crossing,
    }


def compare(
    points: Mapping[str, Sequence[Mapping[str, Any]]],
    low_load_ttft_ms: float,
    slo_ms: float,
    targets: Targets = TARGETS,
) -> dict[str, Any]:
    """cache_aware against fcfs on one workload (``points``: mode -> its points, one per
    rate, same rates). Returns ``per_rate`` rows, ``at_slo`` per mode,
    ``throughput_at_slo_ratio``, the saturating rates and ``verdicts``; a ratio with a zero
    or unknown denominator is None and so is its ``*_met``. O(rates)."""
    fcfs = {p["rate"]: p for p in points.get("fcfs", ())}
    aware = {p["rate"]: p for p in points.get("cache_aware", ())}
    per_rate: list[dict[str, Any]] = []
    for rate in sorted(fcfs.keys() & aware.keys()):
        f, a = fcfs[rate], aware[rate]
        per_rate.append({
            "rate": rate,
            "factor": f.get("factor"),
            "saturated": f["mean_ttft_ms"] >= SATURATION * low_load_ttft_ms,
            "mean_ttft_ratio": _ratio(f["mean_ttft_ms"], a["mean_ttft_ms"]),
            "p99_ttft_ratio": _ratio(a["p99_ttft_ms"], f["p99_ttft_ms"]),
            "throughput_ratio": _ratio(a["throughput_rps"], f["throughput_rps"]),
        })
    at_slo = {mode: slo_throughput(pts, slo_ms) for mode, pts in points.items()}
    slo_ratio = _ratio(at_slo.get("cache_aware", {}).get("throughput_at_slo_rps"),
                       at_slo.get("fcfs", {}).get("throughput_at_slo_rps"))
    saturated = [r for r in per_rate if r["saturated"]]
    speedups = [r["mean_ttft_ratio"] for r in saturated]
    p99s = [r["p99_ttft_ratio"] for r in per_rate]
    min_speedup = None if not speedups or None in speedups else min(speedups)
    max_p99 = None if not p99s or None in p99s else max(p99s)
    return {
        "per_rate": per_rate,
        "saturated_rates": [r["rate"] for r in saturated],
        "at_slo": at_slo,
        "throughput_at_slo_ratio": slo_ratio,
        "verdicts": {
            "min_mean_ttft_ratio_saturated": min_speedup,
            "mean_ttft_met": None if min_speedup is None
            else min_speedup >= targets.mean_ttft_speedup,
            "throughput_at_slo_ratio": slo_ratio,
            "throughput_at_slo_met": None if slo_ratio is None
            else slo_ratio >= targets.throughput_at_slo_ratio,
            "max_p99_ratio": max_p99,
            "p99_met": None if max_p99 is None else max_p99 <= targets.p99_ratio_max,
        },
    }


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or not den:
        return None
    return num / den


def side_by_side(
    ctx: BenchContext,
    traces: Mapping[str, Sequence[TraceRequest]],
    engines: EngineFactory,
    *,
    factors: Sequence[float],
    max_tokens: int,
) -> dict[str, dict[str, Any]]:
    """Serve every workload of ``traces`` under each of :data:`MODES` on the engine
    ``engines(mode)`` gives (one engine per mode, in turn). The first mode's engine also runs
    each workload's low-load pass, which fixes the SLO and the rates (``factor / service
    time``). Returns workload -> its rates, low-load figures, ``points`` (mode -> points) and
    :func:`compare`'s keys. Cost: per workload one sequential pass plus
    ``len(MODES) * len(factors)`` Poisson runs of the trace."""
    out: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        started = time.perf_counter()
        with engines(mode) as engine:
            engine_s = time.perf_counter() - started
            for workload, trace in traces.items():
                w = out.setdefault(workload, {"requests": len(trace), "points": {},
                                              "engine_start_s": {}})
                w["engine_start_s"][mode] = round(engine_s, 1)
                if "rates" not in w:
                    began = time.perf_counter()
                    low = serve(engine, SYSTEMS["no_cache"], trace, max_tokens=max_tokens,
                                desc=f"admission/{workload}/low-load", ctx=ctx)
                    service_s = (time.perf_counter() - began) / len(trace)
                    low_ms = sum(r.report.ttft_ms for r in low) / len(low)
                    w.update(low_load_ttft_ms=low_ms, slo_ms=SLO_FACTOR * low_ms,
                             service_s=service_s,
                             factors=list(factors),
                             rates=[f / service_s for f in factors])
                points = []
                for factor, rate in ctx.bar(list(zip(factors, w["rates"], strict=True)),
                                            f"admission/{workload}/{mode}"):
                    arrivals = poisson_arrivals(len(trace), rate, ctx.seed)
                    results, makespan = serve_poisson(
                        engine, SYSTEMS[SYSTEM], list(trace), arrivals, max_tokens=max_tokens
                    )
                    points.append({"rate": rate, "factor": factor,
                                   **point_stats(results, makespan)})
                w["points"][mode] = points
        print(f"[bench] load admission {mode}: {time.perf_counter() - started:.0f} s",
              file=sys.stderr)
    for w in out.values():
        w.update(compare(w["points"], w["low_load_ttft_ms"], w["slo_ms"]))
    return out


def bench_engines(ctx: BenchContext) -> EngineFactory:
    """The suite's engines: ``fcfs`` is the bench's own engine (left running), any other mode
    a new engine with the bench's settings plus ``admission=mode``, started after the bench's
    engine is closed (one engine at a time) and closed after use."""

    @contextmanager
    def engine_for(mode: str) -> Iterator[CraftEngine]:
        if mode == "fcfs":
            yield ctx.get_engine()
            return
        from craft_rag.engine import CraftEngine, EngineSettings

        ctx.close()
        engine = CraftEngine(EngineSettings(
            block_size=ctx.block_size, max_model_len=ctx.max_model_len, admission=mode,
        ))
        try:
            yield engine
        finally:
            engine.close()

    return engine_for


def run_admission(ctx: BenchContext, engines: EngineFactory | None = None) -> dict[str, Any]:
    """The ``admission`` key of the load suite's result: settings, targets and, per workload,
    :func:`side_by_side`'s figures. ``skipped`` (and no workloads) when ``admission_factors``
    is empty or the bench runs on an engine handed in by the caller (its scheduler cannot
    change) and no ``engines`` factory is given."""
    sizes = ctx.sizes
    out: dict[str, Any] = {
        "modes": list(MODES), "system": SYSTEM, "window": DEFAULT_WINDOW,
        "factors": list(sizes.admission_factors), "max_tokens": sizes.ttft_max_tokens,
        "saturation": SATURATION, "targets": asdict(TARGETS), "workloads": {},
    }
    if not sizes.admission_factors:
        out["skipped"] = "no rates (--admission-factors none)"
        return out
    if engines is None:
        if ctx.engine is not None and not ctx.owns_engine:
            out["skipped"] = ("an engine handed in by the caller cannot change its scheduler; "
                              "run `craft-rag bench load` on its own")
            return out
        engines = bench_engines(ctx)
    traces = {}
    for workload in ctx.workloads(WORKLOADS):
        trace = [r for r in ctx.trace(workload, sizes.admission_requests)
                 if r.conversation_id is None]
        if trace:
            traces[workload] = trace
    if not traces:
        out["skipped"] = "no single-turn requests (no conversation_id) in the trace"
        return out
    out["workloads"] = side_by_side(ctx, traces, engines, factors=sizes.admission_factors,
                                    max_tokens=sizes.ttft_max_tokens)
    return out


def report_lines(adm: Mapping[str, Any]) -> list[str]:
    """Markdown for the generated report: one table per workload (per rate: both modes' mean
    and p99 TTFT and throughput, the ratios, saturation), then the verdicts."""
    if adm.get("skipped"):
        return [f"Admission comparison skipped: {adm['skipped']}."]
    t = adm["targets"]
    out: list[str] = []
    for workload, w in adm["workloads"].items():
        by_rate = {mode: {p["rate"]: p for p in pts} for mode, pts in w["points"].items()}
        out += [f"Admission, {workload}: {w['requests']} requests, {adm['system']}, window "
                f"{adm['window']}; low-load TTFT {w['low_load_ttft_ms']:.0f} ms, SLO "
                f"{w['slo_ms']:.0f} ms, service {w['service_s'] * 1000:.0f} ms/request.", "",
                "| rate req/s | x service | saturated | mean ms fcfs / cache_aware | ratio | "
                "p99 ms fcfs / cache_aware | ratio | throughput fcfs / cache_aware |",
                "|---|---|---|---|---|---|---|---|"]
        for r in w["per_rate"]:
            f, a = by_rate["fcfs"][r["rate"]], by_rate["cache_aware"][r["rate"]]
            out.append(
                f"| {r['rate']:.3g} | {r['factor']:g} | {'yes' if r['saturated'] else 'no'} | "
                f"{f['mean_ttft_ms']:.0f} / {a['mean_ttft_ms']:.0f} | "
                f"{_fmt(r['mean_ttft_ratio'])} | {f['p99_ttft_ms']:.0f} / "
                f"{a['p99_ttft_ms']:.0f} | {_fmt(r['p99_ttft_ratio'])} | "
                f"{f['throughput_rps']:.2f} / {a['throughput_rps']:.2f} |")
        v = w["verdicts"]
        out += ["",
                f"- mean TTFT fcfs / cache_aware at saturating rates: min "
                f"{_fmt(v['min_mean_ttft_ratio_saturated'])}x (target >= "
                f"{t['mean_ttft_speedup']}; met: {v['mean_ttft_met']})",
                f"- throughput at the SLO cache_aware / fcfs: "
                f"{_fmt(v['throughput_at_slo_ratio'])}x (target >= "
                f"{t['throughput_at_slo_ratio']}; met: {v['throughput_at_slo_met']})",
                f"- p99 TTFT cache_aware / fcfs: max {_fmt(v['max_p99_ratio'])}x (target <= "
                f"{t['p99_ratio_max']}; met: {v['p99_met']})", ""]
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
