"""Suite ``routing`` (issue 14): KV-aware routing across N simulated replicas.

Replays one trace through :func:`craft_rag.routing.simulator.simulate` for every routing policy,
every N in ``sizes.routing_replicas`` and two per-replica KV capacities, and measures the
routing decision's cost at each N and N = 32 (see :func:`_decision_latency`). The prefill
model is fitted on the real in-process engine on full runs (~20 requests: cold, fully cached
and partly cached prompts of 1-5 chunks) and is the ENGINE_NOTES fit on ``--quick``.

Trace: ``--trace FILE`` if given; else (``--quick``: the first 400 requests of HotpotQA's) a
SQuAD + HotpotQA trace at natural length (every
question, plus Zipf re-asks, half of them reworded) retrieved top-5 by a hashed lexical
embedding over the two datasets' passages. The lexical retriever stands in for MiniLM because
embedding the 15k-passage union corpus takes tens of minutes on a shared 2-core machine; what
routing needs from a trace is its chunk sharing (exact re-asks retrieve the same list, reworded
ones an overlapping set in another order), which it keeps.
"""

from __future__ import annotations

import random
import re
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from craft_rag.routing.policies import ROUTING_POLICIES
from craft_rag.routing.queueing import DEFAULT_TTFT_MODEL, TTFTModel, TTFTPoint, fit_ttft_model
from craft_rag.routing.simulator import SimConfig, prepare_trace, simulate
from craft_rag.trace import TraceRequest
from craft_rag_bench.bench.context import CUSTOM_TRACE, BenchContext

if TYPE_CHECKING:
    import numpy as np

    from craft_rag.engine import CraftEngine

POLICIES: tuple[str, ...] = tuple(ROUTING_POLICIES)
CAPACITIES: tuple[int, ...] = (8192, 65536)
"""Per-replica KV capacity in tokens: ~10 and ~80 prompts of this trace."""
LOAD = 0.7
LATENCY_REPLICAS = 32
LATENCY_REPEATS = 3
QUICK_REQUESTS = 400
CALIBRATION_POINTS = 20


def parse_replicas(text: str) -> tuple[int, ...]:
    """``"2,8,32"`` -> ``(2, 8, 32)``; ``ValueError`` naming the bad entry (every N >= 1)."""
    out: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            msg = f"--replicas: {part!r} is not a replica count >= 1 (e.g. --replicas 2,8,32)"
            raise ValueError(msg)
        out.append(int(part))
    return tuple(dict.fromkeys(out))


# ---- the trace ------------------------------------------------------------------------------

_WORD = re.compile(r"\w+", re.UNICODE)
_STOP = frozenset(
    {"the", "a", "an", "of", "in", "on", "at", "to", "and", "or", "is", "are", "was", "were",
     "be", "by", "for", "with", "as", "from", "that", "this", "which", "what", "who", "whom",
     "when", "where", "why", "how", "did", "does", "do", "it", "its"}
)


class HashedLexicalEmbedder:
    """Bag of lower-cased words (stopwords out) hashed (crc32) into ``dim`` buckets with
    ``1 + log(tf)`` weights, L2-normalised: a deterministic, offline stand-in for MiniLM
    with the :class:`craft_rag_bench.retrieval.Embedder` interface. O(text length) per text."""

    def __init__(self, dim: int = 1024) -> None:
        self.dim = dim
        self.model_id = f"hashed-lexical-v1:{dim}"

    def encode(self, texts: Sequence[str], *, progress: Any = None) -> np.ndarray:
        import numpy as np

        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            counts: dict[int, int] = {}
            for word in _WORD.findall(text.lower()):
                if word not in _STOP:
                    bucket = zlib.crc32(word.encode("utf-8")) % self.dim
                    counts[bucket] = counts.get(bucket, 0) + 1
            for bucket, tf in counts.items():
                out[row, bucket] = 1.0 + np.log(tf)
            if not counts:
                out[row, 0] = 1.0
            if progress is not None:
                progress.update(1)
        out /= np.linalg.norm(out, axis=1, keepdims=True)
        return out


def lexical_trace(
    datasets: Sequence[str], *, requests: int | None, seed: int, progress: bool = False
) -> list[TraceRequest]:
    """Single-turn traces of ``datasets`` (natural length, or ``requests`` in all), retrieved
    top-5 over their own passages by :class:`HashedLexicalEmbedder`, interleaved by a seeded
    shuffle that keeps each dataset's order. Seconds for SQuAD + HotpotQA."""
    from craft_rag_bench.datasets import load_dataset, passage_corpus
    from craft_rag_bench.retrieval import Retriever
    from craft_rag_bench.workloads import single_turn_trace

    with tempfile.TemporaryDirectory(prefix="craft-rag-lexical-") as cache:
        retriever = Retriever.build(
            list(passage_corpus(datasets)), embedder=HashedLexicalEmbedder(),  # type: ignore[arg-type]
            kind="flat", cache_dir=Path(cache), show_progress=progress,
        )
        parts = [
            single_turn_trace(
                load_dataset(name).questions, retriever, requests=None, top_k=5, repeat=0.3,
                zipf=1.0, near_duplicates=0.5, seed=seed, show_progress=progress,
            )
            for name in datasets
        ]
    rng = random.Random(seed)
    slots = [i for i, part in enumerate(parts) for _ in part]
    rng.shuffle(slots)
    cursors = [0] * len(parts)
    merged: list[TraceRequest] = []
    for i in slots:
        merged.append(parts[i][cursors[i]])
        cursors[i] += 1
    return merged[:requests] if requests is not None else merged


# ---- calibration on the real engine ---------------------------------------------------------


def measure_ttft_points(
    engine: CraftEngine, trace: Sequence[TraceRequest], points: int = CALIBRATION_POINTS
) -> list[TTFTPoint]:
    """TTFT of ``points`` engine requests spanning uncached/cached token mixes: per trace
    request (1-5 chunks) a cold prompt after a cache reset, the same chunks with another
    question (cached up to the question), and a prompt whose first half is cached.
    ``max_tokens=1``. Cost: ``points`` prefills (~0.1-1 s each on this CPU)."""
    out: list[TTFTPoint] = []
    i = 0
    while len(out) < points and i < len(trace):
        request = trace[i]
        chunks = list(request.chunks[: 1 + i % len(request.chunks)])
        i += 1
        if not engine.reset_prefix_cache():
            continue
        steps = [
            (chunks[: max(1, len(chunks) // 2)], request.query),
            (chunks, request.query),
            (chunks, "In one word: " + request.query),
        ]
        for step_chunks, question in steps:
            result = engine.generate(step_chunks, question, max_tokens=1)
            report = result.report
            out.append(TTFTPoint(report.uncached_tokens, report.cached_tokens,
                                 report.ttft_ms / 1000))
    return out[:points]


# ---- real replicas ---------------------------------------------------------------------------


def serve_on_replicas(
    engines: Mapping[str, CraftEngine],
    trace: Sequence[TraceRequest],
    policy: str,
    prompt_tokens: Callable[[TraceRequest], int],
    *,
    max_tokens: int = 1,
) -> dict[str, Any]:
    """Serve ``trace`` (single-turn requests, one at a time) through a :class:`Router` over
    real engines (``CraftEngine(server=URL)`` each), every engine starting from an empty
    prefix cache and a fresh planner configured as the policy's replicas. The router reads the
    engines' own planners (kept true by their KV events); each engine commits its plan. A policy
    with an ``app_ordering`` (a serving layer fed ordered prompts) gets its prompts ordered by
    one app planner first, which commits each served plan with the engine's reuse report.
    Returns :func:`craft_rag_bench.demo.request_summary` (cached-token fraction, mean/p50/p99
    TTFT), every TTFT (in trace order) and requests per replica."""
    from dataclasses import replace
    from typing import cast

    from craft_rag.planner import CraftPlanner
    from craft_rag.routing.router import Router, RouterConfig
    from craft_rag_bench.demo import request_summary

    block = next(iter(engines.values())).block_size
    sources = {
        name: (lambda salt, e=engine: cast(CraftPlanner, e.planner_for(salt)))
        for name, engine in engines.items()
    }
    router = Router(list(engines), policy, RouterConfig(block_size=block),
                    planner_sources=sources)
    for engine in engines.values():
        engine.set_planner(CraftPlanner(router.planner_config))
        if not engine.reset_prefix_cache():
            msg = "could not reset a replica's prefix cache (requests still running?)"
            raise RuntimeError(msg)
    app_ordering = router.policy.app_ordering
    app = None if app_ordering is None else CraftPlanner(
        replace(router.planner_config, policy=app_ordering)
    )
    ttfts: list[float] = []
    cached = prompt = 0
    per_replica = dict.fromkeys(engines, 0)
    for request in trace:
        chunks, app_plan = request.chunks, None
        if app is not None:
            app_plan = app.plan(chunks)
            chunks = app_plan.ordered
        decision = router.route(chunks, prompt_tokens=prompt_tokens(request))
        try:
            result = engines[decision.replica].generate(
                list(decision.plan.ordered), request.query, plan=decision.plan,
                max_tokens=max_tokens,
            )
        except BaseException:
            if app is not None and app_plan is not None:
                app.abort(app_plan)
            raise
        finally:
            router.finish(decision)
        if app is not None and app_plan is not None:
            app.commit(app_plan, prefix_tokens=result.report.prefix_tokens,
                       reused_chunks=result.report.reused_chunks)
        ttfts.append(result.report.ttft_ms)
        cached += result.report.cached_tokens
        prompt += result.report.prompt_tokens
        per_replica[decision.replica] += 1
    return {
        "policy": policy,
        **request_summary(ttfts, prompt, cached),
        "ttft_ms": ttfts,
        "requests_per_replica": per_replica,
    }


# ---- the suite ------------------------------------------------------------------------------


def _trace(ctx: BenchContext) -> tuple[str, list[TraceRequest]]:
    if ctx.custom:
        trace = ctx.trace(CUSTOM_TRACE, 10**9)
        return CUSTOM_TRACE, trace
    if ctx.quick:
        return "hotpotqa (lexical top-5)", lexical_trace(
            ("hotpotqa",), requests=QUICK_REQUESTS, seed=ctx.seed, progress=False
        )
    return "squad+hotpotqa (lexical top-5)", lexical_trace(
        ("squad", "hotpotqa"), requests=None, seed=ctx.seed, progress=ctx.progress
    )


def run(ctx: BenchContext) -> dict[str, Any]:
    workload, trace = _trace(ctx)
    replicas = ctx.sizes.routing_replicas
    model, calibration = DEFAULT_TTFT_MODEL, "ENGINE_NOTES.md fit (quick run)"
    points: list[TTFTPoint] = []
    if not ctx.quick:
        engine = ctx.get_engine()
        points = measure_ttft_points(engine, trace)
        model = fit_ttft_model(points)
        calibration = f"least squares on {len(points)} engine requests (this run)"
    prepared = prepare_trace(trace, ctx.tokenizer(), ctx.prompt_format())
    rows: list[dict[str, Any]] = []
    cases = [(n, cap, p) for cap in CAPACITIES for n in replicas for p in POLICIES]
    for n, capacity, policy in ctx.bar(cases, "routing"):
        result = simulate(prepared, SimConfig(
            replicas=n, policy=policy, capacity_tokens=capacity, block_size=ctx.block_size,
            load=LOAD, seed=ctx.seed, ttft_model=model,
        ))
        rows.append(result.row())
    latency = _decision_latency(prepared, model, ctx, replicas)
    return {
        "suite": "routing",
        "workload": workload,
        "requests": len(trace),
        "prompt_tokens_mean": sum(prepared.prompt_tokens) / len(prepared.prompt_tokens),
        "replicas": list(replicas),
        "capacities": list(CAPACITIES),
        "load": LOAD,
        "ttft_model": {**model.to_json(), "calibration": calibration,
                       "points": [[p.uncached, p.cached, p.ttft_s] for p in points]},
        "simulated": rows,
        "decision_latency": latency,
        "targets": targets(rows, latency),
    }


def _decision_latency(
    prepared: Any, model: TTFTModel, ctx: BenchContext, replicas: Sequence[int]
) -> dict[str, Any]:
    """Cost of ``Router.route`` under ``craft_joint`` (the larger capacity) at every N of the
    run and N = 32, from ``LATENCY_REPEATS`` runs of the same seed: a run is deterministic, so
    request i meets the same router state in each, and its minimum over the runs strips
    preemption by other jobs on a shared machine (``single_run_*``: the first run alone).
    ``route_*``: the whole call (placement plus the chosen replica's ``plan()``);
    ``placement_*``: the routing decision proper (``route`` less ``plan``, which a single
    replica pays too). The top-level ``p50_us``/``p99_us`` are N = 32's ``route_*``."""
    import os

    from craft_rag.metrics import percentile

    repeats = 1 if ctx.quick else LATENCY_REPEATS
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    per_n: list[dict[str, Any]] = []
    for n in sorted({*replicas, LATENCY_REPLICAS}):
        runs: list[dict[str, list[int]]] = []
        for _ in range(repeats):
            timings: dict[str, list[int]] = {}
            simulate(prepared, SimConfig(
                replicas=n, policy="craft_joint", capacity_tokens=CAPACITIES[-1],
                block_size=ctx.block_size, load=LOAD, seed=ctx.seed, ttft_model=model,
            ), timings=timings)
            runs.append(timings)
        row: dict[str, Any] = {"replicas": n}
        for key in ("route", "placement", "cpu"):
            best = [min(x) / 1000 for x in zip(*(r[f"{key}_ns"] for r in runs), strict=True)]
            first = [x / 1000 for x in runs[0][f"{key}_ns"]]
            row[f"{key}_p50_us"] = round(percentile(best, 50), 1)
            row[f"{key}_p99_us"] = round(percentile(best, 99), 1)
            row[f"single_run_{key}_p99_us"] = round(percentile(first, 99), 1)
        per_n.append(row)
    at32 = next(r for r in per_n if r["replicas"] == LATENCY_REPLICAS)
    return {"replicas": LATENCY_REPLICAS, "policy": "craft_joint",
            "capacity_tokens": CAPACITIES[-1], "requests": len(prepared.requests),
            "repeats": repeats, "p50_us": at32["route_p50_us"], "p99_us": at32["route_p99_us"],
            "placement_p50_us": at32["placement_p50_us"],
            "placement_p99_us": at32["placement_p99_us"],
            "per_n": per_n, "load_average_1min": [round(load_before, 2),
                                                  round(os.getloadavg()[0], 2)],
            "run_seconds": round(time.perf_counter() - started, 1)}


def targets(rows: Sequence[dict[str, Any]], latency: dict[str, Any]) -> dict[str, Any]:
    """Issue 14's simulator targets, checked per (N, capacity)."""
    checks: list[dict[str, Any]] = []
    groups = sorted({(r["replicas"], r["capacity_tokens"]) for r in rows})
    for n, cap in groups:
        group = {r["policy"]: r for r in rows if (r["replicas"], r["capacity_tokens"]) == (n, cap)}
        ours = group.get("craft_joint")
        if ours is None:
            continue
        others = [r for p, r in group.items() if p != "craft_joint"]
        checks.append({
            "replicas": n, "capacity_tokens": cap,
            "highest_cached": all(ours["cached_token_fraction"] > r["cached_token_fraction"]
                                  for r in others),
            "lowest_mean_ttft": all(ours["mean_ttft_ms"] < r["mean_ttft_ms"] for r in others),
            "imbalance_ok": ours["load_imbalance"] <= 1.25,
        })
    return {"per_group": checks,
            "all_met": all(c["highest_cached"] and c["lowest_mean_ttft"] and c["imbalance_ok"]
                           for c in checks),
            "decision_p99_ok": latency["placement_p99_us"] <= 100.0,
            "route_p99_ok": latency["p99_us"] <= 100.0}


# ---- report section and figure --------------------------------------------------------------


def section(r: dict[str, Any]) -> list[str]:
    """Markdown lines for the generated report."""
    model = r["ttft_model"]
    lines = [f"{r['requests']} requests of {r['workload']}, mean prompt "
             f"{r['prompt_tokens_mean']:.0f} tokens, Poisson arrivals at {r['load']:.0%} of the "
             f"no-cache capacity; prefill model ttft = {model['a']:.3f} s + "
             f"{1e3 * model['b']:.3f} ms x uncached + {1e3 * model['c']:.4f} ms x cached "
             f"({model['calibration']}).", "",
             "| KV/replica | N | policy | cached tokens | mean TTFT ms | p99 TTFT ms | "
             "max/mean requests |", "|---|---|---|---|---|---|---|"]
    for x in r["simulated"]:
        lines.append(f"| {x['capacity_tokens']:,} | {x['replicas']} | {x['policy']} | "
                     f"{100 * x['cached_token_fraction']:.1f}% | {x['mean_ttft_ms']:.0f} | "
                     f"{x['p99_ttft_ms']:.0f} | {x['load_imbalance']:.2f} |")
    lat = r["decision_latency"]
    t = r["targets"]
    lines += ["", f"Routing decision ({lat['policy']}, per-request minimum of {lat['repeats']} "
              f"runs, load average {lat['load_average_1min'][0]}-"
              f"{lat['load_average_1min'][1]}): placement p50 / p99 and route() with the "
              "replica's plan() p50 / p99, µs:", "",
              "| N | placement p50 | placement p99 | route p50 | route p99 | "
              "route p99, one run |", "|---|---|---|---|---|---|"]
    for x in lat["per_n"]:
        lines.append(f"| {x['replicas']} | {x['placement_p50_us']:.1f} | "
                     f"{x['placement_p99_us']:.1f} | {x['route_p50_us']:.1f} | "
                     f"{x['route_p99_us']:.1f} | {x['single_run_route_p99_us']:.1f} |")
    lines += ["", f"At N = {lat['replicas']}: placement p99 {lat['placement_p99_us']:.1f} µs "
              f"(target <= 100 µs: {'met' if t['decision_p99_ok'] else 'missed'}), route p99 "
              f"{lat['p99_us']:.1f} µs ({'met' if t['route_p99_ok'] else 'missed'}). "
              "craft_joint highest cached "
              f"fraction, lowest mean TTFT and imbalance <= 1.25 at every (N, capacity): "
              f"{'met' if t['all_met'] else 'missed'}."]
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    """Cached-token fraction and mean TTFT vs N, one line per policy, per capacity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from craft_rag_bench.bench.plots import save_figure

    rows = result["simulated"]
    caps = result["capacities"]
    fig, axes = plt.subplots(2, len(caps), figsize=(4 * len(caps), 5.5), squeeze=False)
    for col, cap in enumerate(caps):
        for policy in POLICIES:
            xs = [r for r in rows if r["policy"] == policy and r["capacity_tokens"] == cap]
            ns = [r["replicas"] for r in xs]
            axes[0][col].plot(ns, [100 * r["cached_token_fraction"] for r in xs], "o-",
                              label=policy)
            axes[1][col].plot(ns, [r["mean_ttft_ms"] for r in xs], "o-", label=policy)
        axes[0][col].set_title(f"KV {cap:,} tokens / replica")
        axes[0][col].set_ylabel("cached prompt tokens (%)")
        axes[1][col].set_ylabel("mean TTFT (ms)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("replicas")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)
