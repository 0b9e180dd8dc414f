"""``craft-rag bench SUITE``: benchmark suites, JSON results, PNG plots and a markdown report.

Suites (one module each under ``craft_rag_bench.bench``): ``overlap``, ``sensitivity``,
``overhead`` (no engine), then ``ttft``, ``kv``, ``quality``, ``topk``, ``load`` (the
in-process vLLM engine; ONE engine serves them all within a process), ``routing``
(simulated replicas; its full run fits the prefill model on the engine). ``all`` runs every suite
in that order (``cache-sizes`` and ``tiers`` aside: one engine per KV size / per system, run
them alone). Each suite writes
``<out>/<suite>.json`` and ``<out>/<suite>.png``; the report ``<out>/report.md`` is regenerated
from every JSON result in ``<out>`` after each suite.
``--quick`` shrinks every size (CI smoke test) and writes under ``benchmarks/results/quick``
unless ``--out`` is given. ``--trace FILE`` serves the whole file in every suite (``--requests
N``: its first N); the count used is printed and recorded in each result. Every file is written
atomically (:mod:`craft_rag.files`); options, the trace and the results folder are checked
before any suite runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from craft_rag.cli_args import (
    check_input_file,
    check_output_folder,
    int_range,
    positive_int,
    seed_int,
)
from craft_rag.files import write_atomic
from craft_rag.trace import count_trace
from craft_rag_bench.bench.context import CUSTOM_TRACE, BenchContext, machine_info
from craft_rag_bench.bench.overhead import measure_overhead

DEFAULT_OUT = Path("benchmarks/results")
QUICK_OUT = DEFAULT_OUT / "quick"

Suite = Callable[[BenchContext], dict[str, Any]]


def run_overhead(ctx: BenchContext) -> dict[str, Any]:
    """Planner plan+commit latency at k=5/20, W=1,000/100,000 after ``overhead_distinct``
    distinct chunks; CA-Table + CP-Tree memory (tracemalloc, a second identical run, ~5x
    slower than the timed one) only for W=100,000, where the table is largest (a W=1,000
    table holds a few thousand chunks; its tree is bounded by the same node cap)."""
    distinct = ctx.sizes.overhead_distinct
    cases = [(k, w) for k in (5, 20) for w in (1000, 100_000)]
    rows = []
    for k, window in ctx.bar(cases, "overhead"):
        for policy in ("frequency", "tree"):
            result = measure_overhead(
                policy=policy, k=k, window=window, distinct=distinct,
                trace_memory=ctx.sizes.overhead_memory and window == 100_000,
            )
            rows.append(result.to_json())
    return {"suite": "overhead", "distinct_chunks": distinct, "rows": rows}


def _lazy(module: str) -> Suite:
    def run(ctx: BenchContext) -> dict[str, Any]:
        import importlib

        result: dict[str, Any] = importlib.import_module(f"craft_rag_bench.bench.{module}").run(ctx)
        return result

    return run


SUITES: dict[str, Suite] = {
    "overlap": _lazy("overlap"),
    "sensitivity": _lazy("sensitivity"),
    "overhead": run_overhead,
    "ttft": _lazy("ttft"),
    "kv": _lazy("kv"),
    "quality": _lazy("quality"),
    "topk": _lazy("topk"),
    "load": _lazy("load"),
    "routing": _lazy("routing"),
    "chat": _lazy("chat"),
    "cache-sizes": _lazy("cache_sizes"),
    "tiers": _lazy("tiers"),
    "chunk-cache": _lazy("chunk_cache_quality"),
    "chunk-cache-speed": _lazy("chunk_cache_speed"),
    "pipeline": _lazy("pipeline"),
}
"""Suite name -> function; ``all`` runs them in this order (engine suites last), except
:data:`NOT_IN_ALL`."""

NOT_IN_ALL = frozenset({"cache-sizes", "tiers", "chunk-cache", "chunk-cache-speed"})
"""Suites ``all`` skips: ``cache-sizes`` starts one engine per KV size, ``tiers`` and
``chunk-cache-speed`` one engine process per system (minutes), ``chunk-cache`` runs the model
layer by layer in torch (an hour at n=100 on 2 CPU cores); run them alone."""

ENGINE_SUITES = frozenset({"ttft", "kv", "quality", "topk", "load", "chat", "cache-sizes",
                           "tiers", "pipeline", "chunk-cache-speed"})


def add_bench_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench", help="run a benchmark suite", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("suite", choices=[*SUITES, "all"])
    p.add_argument("--quick", action="store_true", help="tiny sizes (CI smoke test, < 5 min)")
    p.add_argument("--trace", help="replay-format trace to use in every suite (instead of the "
                   "workloads built from shared/data), served whole unless --requests is given")
    p.add_argument("--requests", type=positive_int, default=None,
                   help="with --trace: serve only its first N requests (default: all)")
    p.add_argument("--distinct", type=int_range(1, 100_000_000), default=None,
                   help="distinct chunks for overhead (default 1,000,000; quick 20,000)")
    p.add_argument("--replicas", default=None,
                   help="routing: replica counts to simulate, e.g. 2,8,32,128 "
                   "(default 2,8,32,128; quick 2,8)")
    p.add_argument("--cache-sizes", default=None,
                   help="cache-sizes: KV cache sizes, names computed from the trace's working set "
                   "(whole, medium, small) or block counts, e.g. whole,medium,small (default) "
                   "or 64,256,4096")
    p.add_argument("--pool-requests", type=int_range(1, 10_000), default=None,
                   help="tiers: the engine's KV pool holds about N mean prompts of the trace "
                   "(default 4)")
    p.add_argument("--tier-ram-mib", type=int_range(1, 1 << 24), default=None,
                   help="tiers: RAM tier size in MiB (default 1024)")
    p.add_argument("--tier-disk-mib", type=int_range(1, 1 << 26), default=None,
                   help="tiers: disk tier size in MiB (default 4096)")
    p.add_argument("--bound-only", action="store_true",
                   help="tiers: only the load-free bound (simulated prefix cache, CRAFT's order "
                   "without eviction, on the pool, on pool + tiers): no engine, seconds")
    p.add_argument("--systems", default=None,
                   help="tiers: only these systems, comma-separated, e.g. craft_tier_pgdsf "
                   "(default: prefix,craft,craft_tier_lru,craft_tier_pgdsf)")
    p.add_argument("--verify-tier-hits", action="store_true",
                   help="tiers: serve every request a tier served tokens to again from scratch "
                   "(no pool, no tier) and compare greedy outputs (one more prefill per hit)")
    p.add_argument("--ttft-passes", type=int_range(1, 8), default=None,
                   help="ttft: serve every system N times in mirrored order (A B .. B A), each "
                   "pass from an empty cache, TTFT over all passes (default 1; 2 against load "
                   "drift on a shared machine)")
    p.add_argument("--admission-factors", default=None,
                   help="load: FCFS vs cache-aware admission at these Poisson rates, as "
                   "multiples of the low-load service rate, e.g. 0.5,1,2,4 (default; quick "
                   "1,4), or none to skip the comparison")
    p.add_argument("--pipeline-vectors", type=int_range(1000, 100_000_000), default=None,
                   help="pipeline: vectors in the synthetic IVF index, sized so that the search "
                   "costs about a prefill on this machine (default 1,000,000; quick 20,000)")
    p.add_argument("--pipeline-index", choices=("flat", "sq8", "pq"), default=None,
                   help="pipeline: IVF index type: flat (4 x dim bytes a vector, default), sq8 "
                   "(8-bit scalar quantizer, dim bytes) or pq (dim / 8 bytes); smaller codes fit "
                   "more vectors, a longer search, in memory")
    p.add_argument("--pipeline-dim", type=int_range(8, 4096), default=None,
                   help="pipeline: vector dimension (default 128; quick 64; 384 is MiniLM's; "
                   "pq needs a multiple of 8)")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--block-size", type=int_range(1, 1 << 16), default=32,
                   help="engine KV block size")
    p.add_argument("--max-model-len", type=int_range(1, 1 << 24), default=4096)
    p.add_argument("--out", default=None,
                   help=f"results folder (default {DEFAULT_OUT}; quick: {QUICK_OUT})")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.set_defaults(func=run_bench)


def check_trace(path: str, requests: int | None) -> tuple[Path, int, int]:
    """Validate a ``--trace`` file whole (streamed: every line parsed, O(1) memory) before any
    suite runs. Returns ``(path, requests used, requests in the file)``; ``ValueError`` for a
    missing, unreadable, malformed (naming the line) or empty trace."""
    trace_path = check_input_file(path, "--trace")
    total = count_trace(trace_path)
    if total == 0:
        msg = f"--trace {path} holds no requests; pass a trace with at least one JSON line"
        raise ValueError(msg)
    return trace_path, total if requests is None else min(requests, total), total


def run_bench(args: argparse.Namespace) -> int:
    """Handler of ``craft-rag bench``: checks every input and the results folder, then runs
    the suites. User errors raise ``ValueError``/``OSError`` (exit 2 in :mod:`craft_rag.cli`)
    before any suite starts."""
    if args.requests is not None and args.trace is None:
        msg = "--requests applies to --trace; pass --trace FILE or drop --requests"
        raise ValueError(msg)
    out = Path(args.out) if args.out is not None else (QUICK_OUT if args.quick else DEFAULT_OUT)
    check_output_folder(out, "--out")
    trace_path = None
    if args.trace is not None:
        trace_path, used, in_file = check_trace(args.trace, args.requests)
        print(f"[bench] --trace {args.trace}: serving {used:,} of its {in_file:,} requests"
              + ("" if used == in_file else " (--requests)"), file=sys.stderr)
    ctx = BenchContext.create(
        quick=args.quick, seed=args.seed, progress=not args.no_progress,
        trace_path=trace_path, trace_requests=args.requests,
        block_size=args.block_size, max_model_len=args.max_model_len,
    )
    if args.replicas is not None:
        from craft_rag_bench.bench.routing import parse_replicas

        replicas = parse_replicas(args.replicas)
    else:
        replicas = None
    cache_sizes = None
    if getattr(args, "cache_sizes", None) is not None:
        from craft_rag_bench.bench.cache_sizes import parse_cache_sizes

        cache_sizes = parse_cache_sizes(args.cache_sizes)
    if args.distinct is not None:
        ctx.with_sizes(overhead_distinct=args.distinct)
    if getattr(args, "admission_factors", None) is not None:
        from craft_rag_bench.bench.load_admission import parse_factors

        ctx.with_sizes(admission_factors=parse_factors(args.admission_factors))
    if getattr(args, "pipeline_vectors", None) is not None:
        ctx.with_sizes(pipeline_vectors=args.pipeline_vectors)
    if getattr(args, "pipeline_index", None) is not None:
        ctx.with_sizes(pipeline_index=args.pipeline_index)
    if getattr(args, "pipeline_dim", None) is not None:
        ctx.with_sizes(pipeline_dim=args.pipeline_dim)
    if args.pipeline_index is not None or args.pipeline_dim is not None:
        from craft_rag_bench.bench.pipeline import check_index_type

        check_index_type(ctx.sizes.pipeline_index, ctx.sizes.pipeline_dim)
    if getattr(args, "ttft_passes", None) is not None:
        ctx.with_sizes(ttft_passes=args.ttft_passes)
    if replicas is not None:
        ctx.with_sizes(routing_replicas=replicas)
    if cache_sizes is not None:
        ctx.with_sizes(cache_sizes=cache_sizes)
    tier_sizes = {
        field: value for field, value in (
            ("tiers_pool_requests", getattr(args, "pool_requests", None)),
            ("tiers_ram_bytes", _mib(getattr(args, "tier_ram_mib", None))),
            ("tiers_disk_bytes", _mib(getattr(args, "tier_disk_mib", None))),
        ) if value is not None
    }
    if getattr(args, "bound_only", False):
        tier_sizes["tiers_bound_only"] = True
    if getattr(args, "verify_tier_hits", False):
        tier_sizes["tiers_verify_tier_hits"] = True
    if getattr(args, "systems", None):
        from craft_rag_bench.bench.tiers import selected_systems

        # ValueError (an unknown name, listing the valid ones) is a usage error: exit 2.
        wanted = tuple(n.strip() for n in args.systems.split(",") if n.strip())
        tier_sizes["tiers_systems"] = tuple(selected_systems(wanted))
    if tier_sizes:
        ctx.with_sizes(**tier_sizes)
    names = [n for n in SUITES if n not in NOT_IN_ALL] if args.suite == "all" else [args.suite]
    started = time.perf_counter()
    try:
        results = run_suites(ctx, names, out, plots=not args.no_plots)
    finally:
        ctx.close()
    total = time.perf_counter() - started
    if args.json:
        payload = finite_json({"results": results, "seconds": round(total, 1)})
        json.dump(payload, sys.stdout, indent=2, allow_nan=False)
        sys.stdout.write("\n")
    else:
        for name, result in results.items():
            print(f"== {name}: {result['seconds']} s -> {out / (name + '.json')}")
        print(f"report: {out / 'report.md'} ({total:.0f} s in all)")
    return 0


def _mib(value: int | None) -> int | None:
    return None if value is None else value << 20


def run_suites(
    ctx: BenchContext, names: list[str], out: Path, *, plots: bool = True
) -> dict[str, dict[str, Any]]:
    """Run ``names`` in order on ``ctx``; write each JSON (and PNG) to ``out`` and refresh the
    report after each. Returns suite -> result."""
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        started = time.perf_counter()
        result = SUITES[name](ctx)
        result["seconds"] = round(time.perf_counter() - started, 1)
        result["quick"] = ctx.quick
        result["trace"] = str(ctx.trace_path) if ctx.trace_path else None
        if ctx.trace_path is not None:
            result["trace_requests"] = len(ctx.trace(CUSTOM_TRACE, 0))
        result["machine"] = machine_info()
        result["date"] = result["machine"]["date"]
        if plots:
            from craft_rag_bench.bench.plots import PLOTTERS

            plotter = PLOTTERS.get(name)  # cache-sizes has no figure (its tables say it all)
            if plotter is not None:
                plotter(result, out / f"{name}.png")  # written atomically (plots.save_figure)
                result["png"] = f"{name}.png"
        result = finite_json(result)
        write_atomic(out / f"{name}.json", json.dumps(result, indent=1, allow_nan=False) + "\n")
        results[name] = result
        write_report(out)
    return results


def write_report(out: Path) -> Path:
    """Regenerate ``out/report.md`` from every suite JSON in ``out``."""
    from craft_rag_bench.bench.report import render_report

    loaded: dict[str, dict[str, Any]] = {}
    for name in SUITES:
        path = out / f"{name}.json"
        if path.is_file():
            try:
                loaded[name] = json.loads(path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                msg = f"{path} is not a results JSON ({e}); remove it or choose another --out"
                raise ValueError(msg) from e
    any_result = next(iter(loaded.values()), {})
    meta = {"machine": any_result.get("machine", {}).get("cpu"),
            "generated": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    path = out / "report.md"
    write_atomic(path, render_report(loaded, meta))
    return path


def finite_json(value: Any) -> Any:
    """``value`` with every NaN/inf float replaced by ``None``, so results are strict JSON
    (``json.dumps`` would write ``NaN``, which JSON parsers other than Python's refuse)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value
