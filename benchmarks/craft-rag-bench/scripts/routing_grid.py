"""Re-run the ``bench routing`` simulator grid and decision-cost measurement with a stored
prefill model (no engine fit): the simulated rows depend only on the trace, the model and the
routing code, so this reproduces a full run's table on a machine that cannot host the engine.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/craft-rag-bench/scripts/routing_grid.py \
        [--model benchmarks/results/routing.json] [--latency-only] [--out FILE]

Writes JSON (``simulated`` rows, ``targets``, ``decision_latency``) to ``--out`` (default
stdout) through ``craft_rag.files.write_atomic``.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("benchmarks/results/routing.json"),
                        help="a bench routing JSON whose ttft_model to use")
    parser.add_argument("--latency-only", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
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
    text = json.dumps(out, indent=1) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        write_atomic(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
