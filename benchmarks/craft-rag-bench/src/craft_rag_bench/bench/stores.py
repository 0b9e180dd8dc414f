"""Planner overhead per request with each shared store: ``python -m craft_rag_bench.bench.stores``.

Times ``plan`` + ``commit`` (k=5, tree policy, W=1,000) per request with no store (local
state, today's path), ``memory://``, ``sqlite:///<tmp>/state.db`` and ``redis://`` (the URL in
``CRAFT_RAG_BENCH_REDIS``, else a throwaway loopback ``redis-server`` started for the run if
the binary exists, else the row is skipped and says why). The same request stream as
``bench overhead``; one planner per store, so each request costs one store round trip in
``plan`` (read the log tail) and one in ``commit`` (append + read back), plus the replay of
its own entry. ``--workers N`` adds a row with N planners sharing the store round-robin (each
also replays the others' entries). Prints one JSON object; ``--out FILE`` also writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from craft_rag.chunk import Chunk
from craft_rag.metrics import percentile
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.stores import StateStore, open_store
from craft_rag_bench.bench.overhead import _requests


def _time(planners: Sequence[CraftPlanner], requests: list[list[Chunk]]) -> list[float]:
    perf = time.perf_counter_ns
    times = []
    for i, request in enumerate(requests):
        planner = planners[i % len(planners)]
        t0 = perf()
        plan = planner.plan(request)
        planner.commit(plan, prefix_tokens=40)
        times.append((perf() - t0) / 1000)
    return times


@contextmanager
def _redis_url() -> Iterator[str | None]:
    url = os.environ.get("CRAFT_RAG_BENCH_REDIS")
    if url:
        yield url
    elif shutil.which("redis-server") is None:
        yield None
    else:
        from craft_rag.stores.local_redis import local_redis

        with local_redis() as started:
            yield started


def measure_stores(*, requests: int, k: int = 5, workers: int = 1, seed: int = 0) -> dict[str, Any]:
    """Rows of p50/p99 plan+commit microseconds per store (see the module docstring)."""
    config = PlannerConfig(policy="tree", window=1000)
    stream = _requests(requests * max(1, k // 2), k, seed)[:requests]
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        redis_url = stack.enter_context(_redis_url())
        urls: list[tuple[str, str | None]] = [
            ("none (local)", None),
            ("memory://", "memory://"),
            ("sqlite", f"sqlite://{tmp}/state.db"),
            ("redis", redis_url),
        ]
        for name, url in urls:
            if name == "redis" and url is None:
                rows.append({"store": name, "skipped": "no redis-server and no "
                             "CRAFT_RAG_BENCH_REDIS"})
                continue
            for n in sorted({1, workers}):
                if url is None and n > 1:
                    continue
                stores: list[StateStore] = []
                planners = []
                for _ in range(n):
                    if url is None:
                        planners.append(CraftPlanner(config))
                        continue
                    store = stores[0] if url == "memory://" and stores else open_store(url)
                    stores.append(store)
                    planners.append(CraftPlanner(config, store=store, namespace=f"bench-{n}"))
                _time(planners, stream[: max(1, len(stream) // 10)])  # warm-up
                times = _time(planners, stream)
                rows.append({
                    "store": name, "workers": n, "requests": len(times),
                    "p50_us": round(percentile(times, 50), 1),
                    "p99_us": round(percentile(times, 99), 1),
                })
                for store in set(stores):
                    store.close()
    return {"suite": "stores", "k": k, "window": 1000, "policy": "tree", "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m craft_rag_bench.bench.stores", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2,000 requests instead of 20,000")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--workers", type=int, default=1, help="also time N planners sharing a store")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    args = p.parse_args(argv)
    n = args.requests or (2_000 if args.quick else 20_000)
    result = measure_stores(requests=n, workers=args.workers)
    text = json.dumps(result, indent=2)
    if args.out:
        from craft_rag.files import write_atomic

        write_atomic(args.out, text + "\n")
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
