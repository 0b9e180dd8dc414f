"""Suite ``sensitivity`` (paper Figs. 14 and 15): CA-Table window and promotion threshold.

Replay-based: for each window W (100 ... unlimited) and each threshold T (1, 2, 3, 5), the
reused-token fraction of the simulated prefix cache and the mean computed (uncached) prompt
tokens per request, which on this CPU machine maps almost linearly onto TTFT (docs/engine.md).
The paper's policy is ``frequency`` with the threshold promotion rule; ``tree`` is shown with
its default ``served`` rule for the window sweep (the threshold does not apply to it) and with
the threshold rule for the threshold sweep. The CA-Table size is the mean number of distinct
chunks inside the window over the trace.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

from craft_rag.planner import PlannerConfig
from craft_rag.trace import TraceRequest
from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.overlap import replay_policy

WORKLOADS: tuple[str, ...] = ("squad",)


def mean_table_size(trace: list[TraceRequest], window: int | None) -> float:
    """Mean distinct chunk count of the last ``window`` requests, over the trace. O(chunks)."""
    counts: Counter[str] = Counter()
    recent: deque[tuple[str, ...]] = deque()
    total = 0
    for request in trace:
        keys = tuple(c.key for c in request.chunks)
        recent.append(keys)
        counts.update(keys)
        if window is not None and len(recent) > window:
            for key in recent.popleft():
                counts[key] -= 1
                if counts[key] == 0:
                    del counts[key]
        total += len(counts)
    return total / len(trace) if trace else 0.0


def _row(
    ctx: BenchContext, workload: str, trace: list[TraceRequest], sweep: str,
    config: PlannerConfig,
) -> dict[str, Any]:
    result = replay_policy(ctx, trace, config)
    return {
        "workload": workload,
        "sweep": sweep,
        "policy": config.policy,
        "promotion": config.promotion_rule,
        "window": config.window,
        "threshold": config.threshold,
        "reused_token_fraction": result.reused_token_fraction,
        "prefix_overlap": result.prefix_overlap,
        "computed_tokens_per_request": (result.prompt_tokens - result.cached_tokens)
        / max(1, result.requests),
        "table_size": mean_table_size(trace, config.window) if sweep == "window" else None,
        "requests": result.requests,
    }


def run(ctx: BenchContext) -> dict[str, Any]:
    sizes = ctx.sizes
    rows: list[dict[str, Any]] = []
    for workload in ctx.workloads(WORKLOADS):
        trace = ctx.trace(workload, sizes.sensitivity_requests)
        cases: list[tuple[str, PlannerConfig]] = []
        for window in sizes.windows:
            cases.append(("window", PlannerConfig(policy="frequency", window=window)))
            cases.append(("window", PlannerConfig(policy="tree", window=window)))
        for threshold in sizes.thresholds:
            for policy in ("frequency", "tree"):
                cases.append(
                    ("threshold",
                     PlannerConfig(policy=policy, threshold=threshold, promotion="threshold"))
                )
        for sweep, config in ctx.bar(cases, f"sensitivity/{workload}"):
            rows.append(_row(ctx, workload, trace, sweep, config))
    return {
        "suite": "sensitivity",
        "windows": [w if w is not None else "unlimited" for w in sizes.windows],
        "thresholds": list(sizes.thresholds),
        "rows": rows,
    }
