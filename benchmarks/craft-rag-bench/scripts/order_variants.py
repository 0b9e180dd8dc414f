"""Replay traces through variants of the ``tree`` order, side by side with ContextPilot
online/offline (issue 16 item 2's experiment harness; variants in ``order_variant_policies``).

Usage::

    python benchmarks/craft-rag-bench/scripts/order_variants.py TRACE [TRACE ...] \
        [--variants base,subtree_64,...] [--fast] [--json OUT.jsonl]

Each variant is registered as an ordering policy for the run and replayed with
``PlannerConfig(policy=name, promotion="served", dedup=False)`` by the suite's own
:func:`craft_rag.replay.replay` (the embedded model's tokenizer and chat format, block 32): the
Prefix overlap and reused-token fraction ``craft-rag bench overlap`` reports for ``tree``
(``base`` reproduces them). ``--fast`` skips the tokenizer and the simulated cache: plan +
commit per request, Prefix overlap by :func:`craft_rag.metrics.prefix_overlap` (equal to the
replay's for single-turn traces while the cache evicts nothing the tree matches; multi-turn
traces need the full replay, whose turns >= 2 are not inserted in the tree). ContextPilot's
orders (``craft_rag_bench.bench.peers``) are cached per trace under ``--cache-dir``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import craft_rag.ordering as O
from craft_rag.files import write_atomic
from craft_rag.metrics import prefix_overlap
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.replay import replay
from craft_rag.trace import TraceRequest, read_trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import order_variant_policies as P

PEERS = ("contextpilot_online", "contextpilot_offline")


def peer_orders(
    trace: list[TraceRequest], path: str, cache_dir: Path
) -> dict[str, list[list[str]]]:
    """ContextPilot's orders of ``trace`` (online and offline), cached by the file's hash."""
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    cache = cache_dir / f"peers_{digest}.json"
    if cache.exists():
        data: dict[str, list[list[str]]] = json.loads(cache.read_text())
        return data
    from craft_rag_bench.bench.peers import peer_orders as run_peer

    out = {name: [[c.key for c in o] for o in run_peer(name, [r.chunks for r in trace])]
           for name in PEERS}
    cache_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(cache, json.dumps(out))
    return out


def with_orders(trace: list[TraceRequest], orders: list[list[str]]) -> list[TraceRequest]:
    out = []
    for r, keys in zip(trace, orders, strict=True):
        by_key = {c.key: c for c in r.chunks}
        out.append(replace(r, chunks=tuple(by_key[k] for k in keys)))
    return out


def fast_orders(trace: list[TraceRequest], policy: str) -> list[tuple[str, ...]]:
    """Each request's order under ``policy``: plan + commit, no cache, no conversations."""
    planner = CraftPlanner(PlannerConfig(policy=policy, promotion="served", dedup=False))
    orders: list[tuple[str, ...]] = []
    for r in trace:
        plan = planner.plan(r.chunks)
        planner.commit(plan)
        orders.append(tuple(c.key for c in plan.ordered))
    return orders


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--variants", default=",".join(P.VARIANTS))
    ap.add_argument("--fast", action="store_true", help="no tokenizer/cache: Prefix overlap only")
    ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/craft-rag/order-variants"))
    ap.add_argument("--json", default=None, help="append one JSON line per row here")
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    for name in names:
        O.ORDERING_POLICIES[name] = P.VARIANTS[name]  # type: ignore[index]
    tok = fmt = None
    if not args.fast:
        from craft_rag_bench.bench.context import BenchContext

        ctx = BenchContext(progress=False)
        tok, fmt = ctx.tokenizer(), ctx.prompt_format()

    def run(trace: list[TraceRequest], policy: str, **kw: str) -> tuple[float, float | None]:
        config = PlannerConfig(policy=policy, dedup=False, **kw)  # type: ignore[arg-type]
        r = replay(trace, config, tok, prompt_format=fmt, block_size=32)  # type: ignore[arg-type]
        return r.prefix_overlap, r.reused_token_fraction

    for path in args.traces:
        trace = read_trace(path)
        P.FUTURE[:] = [[c.key for c in r.chunks] for r in trace]
        P.PAST[:] = [set(keys) for keys in P.FUTURE]
        print(f"== {path} ({len(trace)} requests)", flush=True)
        rows: dict[str, tuple[float, float | None]] = {}
        for peer, orders in peer_orders(trace, path, Path(args.cache_dir)).items():
            if args.fast:
                rows[peer] = (prefix_overlap(orders), None)
            else:
                rows[peer] = run(with_orders(trace, orders), "retriever")
        for name in names:
            t0 = time.time()
            if args.fast:
                rows[name] = (prefix_overlap(fast_orders(trace, name)), None)
            else:
                rows[name] = run(trace, name, promotion="served")
            rows[name + "\0"] = (time.time() - t0, None)
        on, off = rows["contextpilot_online"], rows["contextpilot_offline"]
        for name, (pre, reuse) in rows.items():
            if name.endswith("\0"):
                continue
            line = f"{name:22s} prefix {pre:.4f} (/on {pre / on[0]:.3f}, /off {pre / off[0]:.3f})"
            if reuse is not None and on[1] and off[1]:
                line += f"  reuse {reuse:.4f} (/on {reuse / on[1]:.3f}, /off {reuse / off[1]:.3f})"
            print(line, flush=True)
            if args.json:
                with open(args.json, "a") as fh:
                    fh.write(json.dumps({"trace": path, "variant": name, "prefix": pre,
                                         "reuse": reuse}) + "\n")


if __name__ == "__main__":
    main()
