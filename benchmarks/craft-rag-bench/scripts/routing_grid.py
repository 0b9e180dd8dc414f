"""Re-run the ``bench routing`` simulator grid and decision-cost measurement with a stored
prefill model (no engine fit): the simulated rows depend only on the trace, the model and the
routing code, so this reproduces a full run's table on a machine that cannot host the engine.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/craft-rag-bench/scripts/routing_grid.py \
        [--model benchmarks/results/routing.json] [--latency-only] [--replica-test] [--out FILE]

Writes JSON (``simulated`` rows, ``targets``, ``decision_latency``) to ``--out`` (default
stdout) through ``craft_rag.files.write_atomic``.

``--replica-test`` instead predicts the real two-replica test
(``tests/test_routing_replicas.py``): its 60 requests one at a time (each finished before the
next is routed) through 2 simulated replicas of ``REPLICA_TEST_KV_MIB`` of KV each; prints each
policy's cached tokens and the ratios the test asserts (seconds; no engine).
``--replica-sweep`` runs the same prediction over KV sizes (``--sizes``, MiB) and trace lengths
(``--lengths``): the table behind the test's KV size in docs/routing.md (~10 s).
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
REPLICA_TEST_KV_MIB = 48
"""The real test's ``KV_BYTES`` (keep the two equal): 48 MiB per server."""
KV_BYTES_PER_TOKEN = 23_040
"""SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x 2 (K, V) x 2 bytes."""
SWEEP_SIZES_MIB = (46, 48, 50, 52, 56, 64, 72, 80, 96, 112, 128)
SWEEP_LENGTHS = (60, 100, 150)


def kv_tokens(kv_bytes: int, block_size: int = 32) -> int:
    """Usable prefix-cache tokens of a vLLM server given ``kv_bytes`` of KV: whole blocks of
    ``block_size`` tokens, less vLLM's null block. 96 MiB -> 136 blocks -> 4,320 tokens, which
    reproduced the real run of 2026-11-24 01:00 UTC exactly for round_robin, least_loaded and
    prefix_fixed_order and within 64 tokens for craft_joint (KV events reach the real router
    asynchronously); 48 MiB -> 68 blocks -> 2,144 tokens (but see ``REPLICA_TEST_KV_TOKENS``)."""
    return (kv_bytes // (KV_BYTES_PER_TOKEN * block_size) - 1) * block_size


REPLICA_TEST_KV_TOKENS = kv_tokens(REPLICA_TEST_KV_MIB << 20) - 32
"""The real 48 MiB run (2026-11-24 05:14 UTC) is reproduced exactly (round_robin 8,192,
least_loaded 8,192, prefix_fixed_order 7,360 tokens; craft_joint 10,944 = its second pass) at
one block fewer than :func:`kv_tokens` gives: 2,112 tokens. The simulator does not model vLLM's
own block allocation block-exactly, so a size maps to its byte count +-1 block; at 96 MiB the
byte count reproduced the real run, at 48 MiB one block fewer (``--offset-blocks``)."""


def replica_test_prediction(
    ctx: BenchContext,
    *,
    requests: int = REPLICA_TEST_REQUESTS,
    kv_tokens_per_replica: int = REPLICA_TEST_KV_TOKENS,
    trace: list[Any] | None = None,
) -> dict[str, Any]:
    """Cached tokens per policy of the real two-replica test, simulated: its trace, order and
    KV size; sequential (a negligible offered load: every request finishes before the next
    arrives, so the load term is 0 as in the real test). ``mean_ttft_ms``: through the
    quiet-machine prefill model (``DEFAULT_TTFT_MODEL``). ``trace``: the full lexical trace, if
    built already (its first ``requests`` are used)."""
    from craft_rag.routing.queueing import DEFAULT_TTFT_MODEL

    if trace is None:
        trace = bench.lexical_trace(("squad", "hotpotqa"), requests=requests, seed=ctx.seed)
    prepared = prepare_trace(trace[:requests], ctx.tokenizer(), ctx.prompt_format())
    prompt = sum(prepared.prompt_tokens)
    rows: dict[str, Any] = {}
    for policy in bench.POLICIES:
        result = simulate(prepared, SimConfig(
            replicas=2, policy=policy, capacity_tokens=kv_tokens_per_replica,
            block_size=ctx.block_size, load=1e-6, seed=ctx.seed, ttft_model=DEFAULT_TTFT_MODEL,
        ))
        row = result.row()
        rows[policy] = {"cached_tokens": round(result.cached_token_fraction * prompt),
                        "mean_ttft_ms": row["mean_ttft_ms"],
                        "requests_per_replica": list(result.requests_per_replica)}
    joint, rr = rows["craft_joint"]["cached_tokens"], rows["round_robin"]["cached_tokens"]
    fixed = rows["prefix_fixed_order"]["cached_tokens"]
    return {"requests": len(prepared.requests), "kv_tokens_per_replica": kv_tokens_per_replica,
            "prompt_tokens": prompt, "policies": rows,
            "craft_joint_vs_round_robin": round(joint / rr, 3) if rr else None,
            "craft_joint_vs_prefix_fixed_order": round(joint / fixed, 3) if fixed else None,
            "target_1_3x_met": joint >= 1.3 * rr, "more_than_fixed": joint > fixed}


def replica_sweep(
    ctx: BenchContext, sizes_mib: tuple[int, ...], lengths: tuple[int, ...],
    offset_blocks: int = 0,
) -> list[dict[str, Any]]:
    """:func:`replica_test_prediction` for every KV size (MiB per server) and trace length:
    one row each with the cached tokens per policy and the two ratios the test asserts.
    ``offset_blocks``: added to every size's usable blocks (the +-1 block of the mapping)."""
    trace = bench.lexical_trace(("squad", "hotpotqa"), requests=max(lengths), seed=ctx.seed)
    block = ctx.block_size  # the same block size for the byte count and the offset
    out: list[dict[str, Any]] = []
    for n in lengths:
        for mib in sizes_mib:
            p = replica_test_prediction(ctx, requests=n, trace=trace,
                                        kv_tokens_per_replica=kv_tokens(mib << 20, block)
                                        + offset_blocks * block)
            out.append({"requests": n, "kv_mib": mib,
                        "kv_tokens_per_replica": p["kv_tokens_per_replica"],
                        "cached_tokens": {k: v["cached_tokens"] for k, v in p["policies"].items()},
                        "mean_ttft_ms": {k: v["mean_ttft_ms"] for k, v in p["policies"].items()},
                        "craft_joint_vs_round_robin": p["craft_joint_vs_round_robin"],
                        "craft_joint_vs_prefix_fixed_order":
                            p["craft_joint_vs_prefix_fixed_order"]})
    return out


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        msg = f"expected comma-separated integers, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if not values or min(values) < 1:
        msg = f"expected positive integers, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("benchmarks/results/routing.json"),
                        help="a bench routing JSON whose ttft_model to use")
    parser.add_argument("--latency-only", action="store_true")
    parser.add_argument("--replica-test", action="store_true",
                        help="predict the real two-replica test's cached tokens (seconds)")
    parser.add_argument("--replica-sweep", action="store_true",
                        help="the --replica-test prediction over --sizes x --lengths")
    parser.add_argument("--sizes", type=_ints, default=SWEEP_SIZES_MIB,
                        help="KV MiB per server for --replica-sweep (comma-separated)")
    parser.add_argument("--lengths", type=_ints, default=SWEEP_LENGTHS,
                        help="trace lengths for --replica-sweep (comma-separated)")
    parser.add_argument("--offset-blocks", type=int, default=0,
                        help="--replica-sweep: add this many blocks to every size (e.g. -1)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--write-results", action="store_true",
                        help="also replace the rows, latency and targets in --model's JSON "
                             "(its fitted model, points and machine kept; 'recomputed' added) "
                             "and redraw its PNG beside it")
    args = parser.parse_args(argv)
    if args.replica_test or args.replica_sweep:
        ctx = BenchContext(progress=False)
        result: Any = (replica_sweep(ctx, args.sizes, args.lengths, args.offset_blocks)
                       if args.replica_sweep
                       else replica_test_prediction(ctx))
        text = json.dumps(result, indent=1)
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
