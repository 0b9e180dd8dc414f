"""``craft-rag bench SUITE``: benchmark suites. Each writes JSON under benchmarks/results/."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from craft_rag.bench.overhead import measure_overhead


def _suite_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Planner plan+commit latency at k=5/20, W=1,000/100,000, after ``--distinct`` chunks."""
    distinct = 20_000 if args.quick else args.distinct
    cases = [(k, w) for k in (5, 20) for w in (1000, 100_000)]
    rows = []
    for k, window in tqdm(cases, desc="overhead", file=sys.stderr):
        for policy in ("frequency", "tree"):
            result = measure_overhead(
                policy=policy, k=k, window=window, distinct=distinct, trace_memory=not args.quick
            )
            rows.append(result.to_json())
    return {"suite": "overhead", "distinct_chunks": distinct, "rows": rows}


SUITES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "overhead": _suite_overhead,
}


def add_bench_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="run a benchmark suite")
    p.add_argument("suite", choices=[*SUITES, "all"])
    p.add_argument("--quick", action="store_true", help="small sizes (CI smoke test)")
    p.add_argument("--distinct", type=int, default=1_000_000, help="distinct chunks (overhead)")
    p.add_argument("--out", default="benchmarks/results", help="folder for JSON results")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    names = list(SUITES) if args.suite == "all" else [args.suite]
    results: dict[str, Any] = {}
    for name in names:
        started = time.time()
        result = SUITES[name](args)
        result["seconds"] = round(time.time() - started, 1)
        result["machine"] = {"python": platform.python_version(), "cpu": platform.processor()}
        result["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
        results[name] = result
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for name, result in results.items():
            print(f"== {name} ({result['seconds']} s)")
            for row in result.get("rows", []):
                print("  " + ", ".join(f"{k}={v}" for k, v in row.items()))
    return 0
