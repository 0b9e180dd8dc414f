"""Where the planner's cost goes inside a replay (issue 16 item 3 study).

Usage::

    python benchmarks/craft-rag-bench/scripts/planner_in_replay.py [--requests 20000] [--words 64]

Three measurements on the ``overhead`` suite's synthetic stream (k=5, W=1,000, 1M distinct):
1. ``replay``: plan and commit timed apart inside :func:`craft_rag.replay.replay` (hashing
   tokenizer), with the suite's one-token chunks and with ``--words``-word chunks (a real
   chunk's size: every chunk then spans whole KV blocks);
2. ``loop``: the suite's bare plan+commit loop, and the same loop with a turn's worth of other
   work between requests (tokenize a 320-word prompt, hash its 16-token blocks): what that work
   does to the planner's CPU caches.
p50/p99 in µs (wall) over the last quarter of the requests. Not part of the suite.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from typing import Any

from craft_rag.chunk import Chunk
from craft_rag.metrics import percentile
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.replay import replay
from craft_rag.tokenizer import HashingTokenizer
from craft_rag.trace import TraceRequest
from craft_rag_bench.bench.overhead import _requests


def tail(xs: list[float]) -> str:
    xs = xs[-len(xs) // 4:]
    return f"p50 {percentile(xs, 50):6.1f}  p99 {percentile(xs, 99):6.1f}"


def in_replay(requests: list[list[Chunk]], words: int) -> None:
    def text(key: str) -> str:
        return " ".join(f"{key}w{j}" for j in range(words)) if words else key

    trace = [
        TraceRequest(id=str(i), query="q", chunks=tuple(
            Chunk(key=c.key, text=text(c.key), num_tokens=None) for c in r))
        for i, r in enumerate(requests)
    ]
    plan_us: list[float] = []
    commit_us: list[float] = []
    plan, commit = CraftPlanner.plan, CraftPlanner.commit
    perf = time.perf_counter_ns

    def timed(method: Any, sink: list[float]) -> Any:
        def call(self: CraftPlanner, *a: Any, **kw: Any) -> Any:
            t0 = perf()
            try:
                return method(self, *a, **kw)
            finally:
                sink.append((perf() - t0) / 1000)
        return call

    CraftPlanner.plan = timed(plan, plan_us)  # type: ignore[method-assign]
    CraftPlanner.commit = timed(commit, commit_us)  # type: ignore[method-assign]
    try:
        replay(trace, PlannerConfig(policy="tree", window=1000), HashingTokenizer())
    finally:
        CraftPlanner.plan, CraftPlanner.commit = plan, commit  # type: ignore[method-assign]
    both = [a + b for a, b in zip(plan_us, commit_us, strict=True)]
    label = f"{words}-word chunks" if words else "one-token chunks (the suite's)"
    print(f"replay, {label}:")
    print(f"  plan {tail(plan_us)} | commit {tail(commit_us)} | both {tail(both)}")


def loop(requests: list[list[Chunk]], other_work: bool) -> None:
    planner = CraftPlanner(PlannerConfig(policy="tree", window=1000))
    tok = HashingTokenizer()
    prompt = " ".join(f"w{j}x{j * 7}" for j in range(320))
    perf = time.perf_counter_ns
    plan_us: list[float] = []
    commit_us: list[float] = []
    both: list[float] = []
    for i, request in enumerate(requests):
        if other_work:
            ids = tok.encode(prompt + str(i))
            for j in range(0, len(ids), 16):
                hashlib.sha256(repr(ids[j:j + 16]).encode()).digest()
        t0 = perf()
        plan = planner.plan(request)
        t1 = perf()
        planner.commit(plan, prefix_tokens=40)
        t2 = perf()
        plan_us.append((t1 - t0) / 1000)
        commit_us.append((t2 - t1) / 1000)
        both.append((t2 - t0) / 1000)
    print(f"loop, {'a turn of other work between requests' if other_work else 'bare (the suite)'}:")
    print(f"  plan {tail(plan_us)} | commit {tail(commit_us)} | both {tail(both)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--words", type=int, default=64)
    args = ap.parse_args()
    requests = _requests(1_000_000, 5, 0)[: args.requests]
    for _ in range(2):
        in_replay(requests, 0)
        in_replay(requests, args.words)
        loop(requests, False)
        loop(requests, True)


if __name__ == "__main__":
    main()
