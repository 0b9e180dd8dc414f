"""Per-request thread-CPU cost of ``tree`` order variants (plan + commit), on a synthetic Zipf
stream (issue 16 item 2: a variant must not blow the planner's cost budget).

Usage: python order_variant_cost.py [--k 5,20] [--requests 20000] [--distinct 100000]
       [--variants base,subtree_64,cooc_sum]
"""

from __future__ import annotations

import argparse
import bisect
import gc
import random
import sys
import time
from pathlib import Path

import craft_rag.ordering as O
from craft_rag.chunk import Chunk
from craft_rag.planner import CraftPlanner, PlannerConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from order_variant_policies import VARIANTS


def stream(k: int, n: int, distinct: int, seed: int = 0) -> list[list[Chunk]]:
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(distinct)]
    cum: list[float] = []
    acc = 0.0
    for w in weights:
        acc += w
        cum.append(acc)
    pool = [Chunk(key=f"c{i}", text="") for i in range(distinct)]
    out = []
    for _ in range(n):
        keys: dict[int, None] = {}
        while len(keys) < k:
            keys[min(distinct - 1, bisect.bisect(cum, rng.random() * acc))] = None
        out.append([pool[i] for i in keys])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", default="5,20")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--distinct", type=int, default=100000)
    ap.add_argument("--variants", default="base,subtree_64,cooc_sum")
    args = ap.parse_args()
    for name in args.variants.split(","):
        O.ORDERING_POLICIES[name] = VARIANTS[name]  # type: ignore[index]
    for k in (int(x) for x in args.k.split(",")):
        reqs = stream(k, args.requests, args.distinct)
        for name in args.variants.split(","):
            planner = CraftPlanner(PlannerConfig(policy=name, promotion="served", dedup=False))
            warm = len(reqs) // 4
            times: list[int] = []
            gc.collect()
            for i, chunks in enumerate(reqs):
                if i == warm:
                    gc.freeze()
                t0 = time.thread_time_ns()
                plan = planner.plan(chunks)
                planner.commit(plan)
                if i >= warm:
                    times.append(time.thread_time_ns() - t0)
            gc.unfreeze()
            times.sort()
            p50 = times[len(times) // 2] / 1000
            p99 = times[int(len(times) * 0.99)] / 1000
            print(f"k={k:3d} {name:16s} plan+commit thread CPU "
                  f"p50 {p50:6.1f} us  p99 {p99:6.1f} us", flush=True)


if __name__ == "__main__":
    main()
