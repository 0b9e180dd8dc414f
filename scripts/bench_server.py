"""Benchmark: CRAFT over a vLLM server vs CRAFT in-process, side by side in one run.

Serves the same trace (default: the demo's SQuAD trace built from shared/data) under the
retriever's order (prefix caching, no CRAFT) and CRAFT ``tree`` on (a) the in-process engine and
(b) a vLLM OpenAI-compatible server (``craft-rag serve``), one system after another, each from
a cold cache (in-process: a reset; server: a fresh ``cache_salt``). Reports the cached-token
fraction and mean/p50/p99 TTFT per system, and the server's cached tokens as a share of the
in-process ones (issue 13's target: >= 95%).

    craft-rag serve --port 8000 &                 # ~70 s until ready
    .venv/bin/python scripts/bench_server.py --server http://127.0.0.1:8000 --requests 40

Writes ``benchmarks/results/server.json`` (atomic, 0600).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from craft_rag.files import write_atomic
from craft_rag.trace import read_trace
from craft_rag_bench.demo import SYSTEMS, default_trace, run_system, summarise

SYSTEM_NAMES = ("prefix_cache", "craft_tree")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="vLLM server URL (craft-rag serve)")
    parser.add_argument("--trace", default=None, help="replay-format trace (default: SQuAD)")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/server.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if args.trace:
        trace = read_trace(Path(args.trace), limit=args.requests)
    else:
        trace = default_trace(args.requests, 5, 0)

    from craft_rag.engine import CraftEngine, EngineSettings

    by_name = {s.name: s for s in SYSTEMS}
    results: dict[str, Any] = {}
    # The server's max_model_len (craft-rag serve: 4096) and block size 32 on both sides.
    with CraftEngine(server=args.server) as remote:
        settings = EngineSettings(max_model_len=remote.max_model_len, block_size=remote.block_size)
        for name in SYSTEM_NAMES:
            salt = f"bench-{name}-{secrets.token_hex(8)}"
            served = run_system(
                remote,
                by_name[name],
                trace,
                max_tokens=args.max_tokens,
                progress=True,
                cache_salt=salt,
            )
            results[f"server/{name}"] = asdict(summarise(served))
    with CraftEngine(settings) as local:
        for name in SYSTEM_NAMES:
            served = run_system(
                local, by_name[name], trace, max_tokens=args.max_tokens, progress=True
            )
            results[f"in_process/{name}"] = asdict(summarise(served))
    local_cached = results["in_process/craft_tree"]["cached_tokens"]
    remote_cached = results["server/craft_tree"]["cached_tokens"]
    payload = {
        "requests": len(trace),
        "trace": args.trace or "squad (built, top-5, seed 0)",
        "max_tokens": args.max_tokens,
        "server": args.server,
        "systems": results,
        "server_vs_in_process_cached": remote_cached / local_cached if local_cached else None,
    }
    write_atomic(args.out, json.dumps(payload, indent=2) + "\n")
    header = f"{'system':<26}{'cached frac':>12}{'mean TTFT':>11}{'p50':>9}{'p99':>9}"
    print(header)
    for name, r in results.items():
        print(
            f"{name:<26}{r['cached_token_fraction']:>12.3f}{r['mean_ttft_ms']:>11.0f}"
            f"{r['p50_ttft_ms']:>9.0f}{r['p99_ttft_ms']:>9.0f}"
        )
    ratio = payload["server_vs_in_process_cached"]
    print(f"server/in-process cached tokens (CRAFT tree): {ratio:.3f}" if ratio else "n/a")
    return 0


if __name__ == "__main__":
    sys.exit(main())
