"""Benchmark: N worker processes sharing one store, against one vLLM server, vs one worker.

Issue 13's target: with 4 workers sharing Redis the cached-token fraction equals the one-worker
run within 2 points. The trace (a replay-format file) is split round-robin over ``--workers``
spawned processes, each with its own ``CraftEngine(server=URL, store=URL)`` (CRAFT ``tree``).

Modes (each run uses a fresh random ``cache_salt``, so no run sees another's server cache; the
salt also picks a fresh store namespace, so no run sees another's planner state):

* ``ordered`` (default): a turnstile makes request i start only after request i-1 finished
  and was committed, whichever worker served it; like for like with the one-worker run
  (the same requests in the same order), so any gap is what sharing the state loses.
* ``concurrent``: every worker serves its share as fast as it can (up to N requests in flight
  on the server); the order of commits, and so the plans, can differ from the one-worker run.

One warm-up request (worker 0, the run's salt) precedes the measured ones in every run.

    craft-rag serve --port 18200 &
    redis-server --port 16391 --bind 127.0.0.1 --save '' --appendonly no &
    .venv/bin/python scripts/bench_workers.py --server http://127.0.0.1:18200 \\
        --store redis://127.0.0.1:16391/0 --trace trace.jsonl --workers 1 4 --modes ordered

Prints one row per (workers, mode, store) and writes ``--out`` (JSON, atomic, 0600).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import sys
import time
from functools import partial
from multiprocessing.synchronize import Barrier, Condition
from typing import Any

from craft_rag.files import write_atomic
from craft_rag.replay import percentile

_TIMEOUT_S = 600.0


def _is_turn(turn: Any, i: int) -> bool:
    return bool(turn.value == i)


def _worker(
    index: int,
    workers: int,
    args: dict[str, Any],
    salt: str,
    ordered: bool,
    turn: Any,
    cond: Condition,
    barrier: Barrier,
    results: Any,
) -> None:
    """Serve requests ``index, index + workers, ...`` of the trace; put per-request rows."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from craft_rag import make_chunk
    from craft_rag.engine import CraftEngine
    from craft_rag.trace import read_trace

    trace = read_trace(args["trace"], limit=args["requests"])
    rows: list[dict[str, Any]] = []
    with CraftEngine(server=args["server"], store=args["store"]) as engine:
        barrier.wait(timeout=_TIMEOUT_S)  # every engine connected before anything is served
        if index == 0:
            warm = make_chunk("The warm-up passage is not part of the measured run.", id="w:0")
            engine.generate([warm], "Is this a warm-up?", max_tokens=1, cache_salt=salt)
            with cond:
                turn.value = 0
                cond.notify_all()
        else:
            with cond:
                cond.wait_for(lambda: turn.value >= 0, timeout=_TIMEOUT_S)
        for i in range(index, len(trace), workers):
            if ordered:
                with cond:
                    if not cond.wait_for(partial(_is_turn, turn, i), timeout=_TIMEOUT_S):
                        msg = f"worker {index}: timed out waiting for request {i}'s turn"
                        raise RuntimeError(msg)
            request = trace[i]
            t0 = time.perf_counter()
            out = engine.generate(
                request.chunks,
                request.query,
                conversation_id=request.conversation_id,
                max_tokens=args["max_tokens"],
                cache_salt=salt,
            )
            rows.append(
                {
                    "i": i,
                    "worker": index,
                    "prompt_tokens": out.report.prompt_tokens,
                    "cached_tokens": out.report.cached_tokens,
                    "ttft_ms": out.report.ttft_ms,
                    "latency_ms": (time.perf_counter() - t0) * 1000.0,
                }
            )
            if ordered:
                with cond:
                    turn.value = i + 1
                    cond.notify_all()
    results.put(rows)


def run(args: dict[str, Any], workers: int, ordered: bool) -> dict[str, Any]:
    """One run: ``workers`` spawned processes, a fresh salt; the summed aggregates."""
    ctx = mp.get_context("spawn")
    salt = f"bench-workers-{secrets.token_hex(8)}"
    turn = ctx.Value("q", -1, lock=False)
    cond = ctx.Condition()
    barrier = ctx.Barrier(workers)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(w, workers, args, salt, ordered, turn, cond, barrier, results),
        )
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    rows: list[dict[str, Any]] = []
    for _ in procs:
        rows.extend(results.get(timeout=_TIMEOUT_S * 2))
    for p in procs:
        p.join()
        if p.exitcode != 0:
            msg = f"a worker exited with {p.exitcode}"
            raise RuntimeError(msg)
    rows.sort(key=lambda r: r["i"])
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    ttfts = [r["ttft_ms"] for r in rows]
    return {
        "workers": workers,
        "mode": "ordered" if ordered else "concurrent",
        "store": args["store"],
        "requests": len(rows),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_token_fraction": cached / prompt if prompt else 0.0,
        "mean_ttft_ms": sum(ttfts) / len(ttfts),
        "p50_ttft_ms": percentile(ttfts, 50),
        "p99_ttft_ms": percentile(ttfts, 99),
        "per_request_cached": [r["cached_tokens"] for r in rows],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="vLLM server URL (craft-rag serve)")
    parser.add_argument("--store", required=True, help="store URL shared by the workers")
    parser.add_argument("--trace", required=True, help="replay-format trace (JSONL)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument(
        "--modes", nargs="+", choices=("ordered", "concurrent"), default=["ordered"]
    )
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/workers.json")
    ns = parser.parse_args(argv)
    if any(w < 1 for w in ns.workers):
        parser.error("--workers: each N must be >= 1")
    args = {
        "server": ns.server,
        "store": ns.store,
        "trace": ns.trace,
        "requests": ns.requests,
        "max_tokens": ns.max_tokens,
    }
    runs: list[dict[str, Any]] = []
    print(f"{'workers':>7} {'mode':<11}{'cached frac':>12}{'mean TTFT':>11}{'p50':>8}{'p99':>8}")
    for mode in ns.modes:
        for workers in ns.workers:
            r = run(args, workers, mode == "ordered")
            runs.append(r)
            print(
                f"{workers:>7} {mode:<11}{r['cached_token_fraction']:>12.3f}"
                f"{r['mean_ttft_ms']:>11.0f}{r['p50_ttft_ms']:>8.0f}{r['p99_ttft_ms']:>8.0f}",
                flush=True,
            )
    payload = {
        "server": ns.server,
        "store": ns.store,
        "trace": ns.trace,
        "max_tokens": ns.max_tokens,
        "load_average": os.getloadavg(),
        "runs": runs,
    }
    write_atomic(ns.out, json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
