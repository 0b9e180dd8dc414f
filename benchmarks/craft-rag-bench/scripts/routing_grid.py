"""Re-run the ``bench routing`` simulator grid and decision-cost measurement with a stored
prefill model (no engine fit): the simulated rows depend only on the trace, the model and the
routing code, so this reproduces a full run's table on a machine that cannot host the engine.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/craft-rag-bench/scripts/routing_grid.py \
        [--model benchmarks/results/routing.json] [--latency-only] [--replica-test] [--out FILE]

Writes JSON (``simulated`` rows, ``targets``, ``decision_latency``) to ``--out`` (default
stdout) through ``craft_rag.files.write_atomic``.

``--replica-test`` instead predicts the real two-replica test
(``tests/test_routing_replicas.py``): its 60 requests one at a time (each finished before the
next is routed) through 2 simulated replicas of ``REPLICA_TEST_KV_TOKENS``; prints each
policy's cached tokens and the ratios the test asserts (seconds; no engine).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from craft_rag.files import write_atomic
from craft_rag.routing.queueing import TTFTModel
from craft_rag.routing.simulator import SimConfig, prepare_trace, simulate
from craft_rag_bench.bench import routing as bench
from craft_rag_bench.bench.context import BenchContext

REPLICAS = (2, 8, 32, 128)
REPLICA_TEST_REQUESTS = 60
REPLICA_TEST_KV_TOKENS = 4320
"""The real test's servers: 96 MiB of SmolLM2-135M KV (30 layers x 3 KV heads x 64 dims x 2
(K, V) x 2 bytes = 23,040 bytes a token) = 136 blocks of 32, one of them vLLM's null block:
135 usable blocks. This reproduces the real run's cached tokens exactly for round_robin,
least_loaded and prefix_fixed_order and within 64 tokens for craft_joint (KV events reach
the real router asynchronously)."""


def replica_test_prediction(ctx: BenchContext) -> dict[str, Any]:
    """Cached tokens per policy of the real two-replica test, simulated: its trace, order and
    KV size; sequential (a negligible offered load: every request finishes before the next
    arrives, so the load term is 0 as in the real test)."""
    from craft_rag.routing.queueing import DEFAULT_TTFT_MODEL

    trace = bench.lexical_trace(("squad", "hotpotqa"), requests=REPLICA_TEST_REQUESTS,
                                seed=ctx.seed)
    prepared = prepare_trace(trace, ctx.tokenizer(), ctx.prompt_format())
    prompt = sum(prepared.prompt_tokens)
    rows: dict[str, Any] = {}
    for policy in bench.POLICIES:
        result = simulate(prepared, SimConfig(
            replicas=2, policy=policy, capacity_tokens=REPLICA_TEST_KV_TOKENS,
            block_size=ctx.block_size, load=1e-6, seed=ctx.seed, ttft_model=DEFAULT_TTFT_MODEL,
        ))
        rows[policy] = {"cached_tokens": round(result.cached_token_fraction * prompt),
                        "requests_per_replica": list(result.requests_per_replica)}
    joint, rr = rows["craft_joint"]["cached_tokens"], rows["round_robin"]["cached_tokens"]
    fixed = rows["prefix_fixed_order"]["cached_tokens"]
    return {"requests": len(trace), "kv_tokens_per_replica": REPLICA_TEST_KV_TOKENS,
            "prompt_tokens": prompt, "policies": rows,
            "craft_joint_vs_round_robin": round(joint / rr, 3) if rr else None,
            "craft_joint_vs_prefix_fixed_order": round(joint / fixed, 3) if fixed else None,
            "target_1_3x_met": joint >= 1.3 * rr, "more_than_fixed": joint > fixed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("benchmarks/results/routing.json"),
                        help="a bench routing JSON whose ttft_model to use")
    parser.add_argument("--latency-only", action="store_true")
    parser.add_argument("--replica-test", action="store_true",
                        help="predict the real two-replica test's cached tokens (seconds)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--write-results", action="store_true",
                        help="also replace the rows, latency and targets in --model's JSON "
                             "(its fitted model, points and machine kept; 'recomputed' added) "
                             "and redraw its PNG beside it")
    args = parser.parse_args(argv)
    if args.replica_test:
        text = json.dumps(replica_test_prediction(BenchContext(progress=False)), indent=1)
        if args.out is None:
            sys.stdout.write(text + "\n")
        else:
            write_atomic(args.out, text + "\n")
        return 0
    stored = json.loads(args.model.read_text())["ttft_model"]
    model = TTFTModel(stored["a"], stored["b"], stored["c"])
    ctx = BenchContext(progress=False)
    started = time.perf_counter()
    trace = bench.lexical_trace(("squad", "hotpotqa"), requests=None, seed=ctx.seed)
    prepared = prepare_trace(trace, ctx.tokenizer(), ctx.prompt_format())
    rows: list[dict[str, Any]] = []
    if not args.latency_only:
        for capacity in bench.CAPACITIES:
            for n in REPLICAS:
                for policy in bench.POLICIES:
                    rows.append(simulate(prepared, SimConfig(
                        replicas=n, policy=policy, capacity_tokens=capacity,
                        block_size=ctx.block_size, load=bench.LOAD, seed=ctx.seed,
                        ttft_model=model,
                    )).row())
    latency = bench._decision_latency(prepared, model, ctx, REPLICAS)
    out = {"requests": len(trace), "ttft_model": stored, "simulated": rows,
           "decision_latency": latency, "targets": bench.targets(rows, latency),
           "seconds": round(time.perf_counter() - started, 1)}
    if args.write_results and not args.latency_only:
        import datetime
        import os

        results = json.loads(args.model.read_text())
        results.update(simulated=rows, decision_latency=latency, targets=out["targets"])
        results["recomputed"] = {
            "by": "routing_grid.py (stored model)", "seconds": out["seconds"],
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "load_avg": [round(x, 2) for x in os.getloadavg()],
        }
        write_atomic(args.model, json.dumps(results, indent=1) + "\n")
        bench.plot(results, args.model.with_suffix(".png"))
    text = json.dumps(out, indent=1) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        write_atomic(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
