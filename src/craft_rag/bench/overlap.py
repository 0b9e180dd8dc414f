"""Suite ``overlap`` (paper Fig. 3, and issue 3's replay of shared/data traces).

For each workload: Prefix and Total overlap (§3.1) of the retrieved lists as retrieved, and of
the order the engine would see under the retriever order, CRAFT ``frequency`` and CRAFT
``tree`` (replayed without dedup: the figure is about order), plus the simulated prefix cache's
reused token fraction with dedup off and on, from a replay with the embedded model's tokenizer
and chat format. Total overlap is order-free, the same under every policy; it bounds what any
order can align. Multi-turn overlap counts chunks repeated within a conversation too.
Cost: a replay is O(prompt tokens) per request.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from craft_rag.bench.context import MULTI_TURN, SINGLE_TURN, BenchContext
from craft_rag.metrics import prefix_overlap, total_overlap
from craft_rag.planner import PlannerConfig
from craft_rag.replay import ReplayResult, replay
from craft_rag.trace import TraceRequest
from craft_rag.workloads import sharing_report

POLICIES: tuple[str, ...] = ("retriever", "frequency", "tree")


def replay_policy(
    ctx: BenchContext,
    trace: list[TraceRequest],
    config: PlannerConfig,
    *,
    block_size: int = 32,
    cache_tokens: int | None = None,
    max_model_len: int | None = None,
    max_tokens: int = 0,
) -> ReplayResult:
    """One replay with the bench's tokenizer and prompt format (and, given ``max_model_len``,
    the engine's oldest-turn dropping)."""
    kwargs: dict[str, Any] = {"max_model_len": max_model_len, "max_tokens": max_tokens}
    if cache_tokens is not None:
        kwargs["cache_tokens"] = cache_tokens
    return replay(
        trace,
        config,
        ctx.tokenizer(),
        prompt_format=ctx.prompt_format(),
        block_size=block_size,
        **kwargs,
    )


def overlap_requests(ctx: BenchContext, workload: str) -> int:
    """``overlap_requests``, capped for small single-turn datasets at their natural length
    (every question once plus its expected re-asks): past it a trace is re-asks only, which
    would inflate its overlap (TriviaQA has 150 questions, HotpotQA and 2Wiki 500)."""
    requests = ctx.sizes.overlap_requests
    if workload in SINGLE_TURN:
        from craft_rag.datasets import load_dataset
        from craft_rag.workloads import TraceConfig

        questions = len(load_dataset(workload).questions)
        requests = min(requests, int(questions / (1.0 - TraceConfig(dataset=workload).repeat)))
    return requests


def run(ctx: BenchContext) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    workloads = ctx.workloads([*SINGLE_TURN, *MULTI_TURN])
    for workload in ctx.bar(workloads, "overlap"):
        trace = ctx.trace(workload, overlap_requests(ctx, workload))
        sharing = sharing_report(trace)
        retrieved = [tuple(c.key for c in r.chunks) for r in trace]
        for policy in POLICIES:
            # Overlap of the order each policy sends, without dedup (Fig. 3 is about order);
            # reuse with the library's default settings (dedup on).
            ordered = replay_policy(ctx, trace, PlannerConfig(policy=policy, dedup=False))
            result = replay_policy(ctx, trace, PlannerConfig(policy=policy))
            rows.append(
                {
                    "workload": workload,
                    "policy": policy,
                    "requests": result.requests,
                    "retrieved_prefix_overlap": prefix_overlap(retrieved),
                    "retrieved_total_overlap": total_overlap(retrieved),
                    "prefix_overlap": ordered.prefix_overlap,
                    "total_overlap": ordered.total_overlap,
                    "reused_token_fraction_no_dedup": ordered.reused_token_fraction,
                    "reused_token_fraction": result.reused_token_fraction,
                    "reused_chunk_fraction": result.reused_chunk_fraction,
                    "dedup_removed_fraction": result.dedup_removed_fraction,
                    "prompt_tokens": result.prompt_tokens,
                    "cached_tokens": result.cached_tokens,
                    "planner_us_p50": result.planner_us_p50,
                    "planner_us_p99": result.planner_us_p99,
                    "sharing": asdict(sharing),
                }
            )
    by_policy = {
        p: [r for r in rows if r["policy"] == p] for p in POLICIES
    }
    mean = {
        p: {
            "prefix_overlap": _mean([r["prefix_overlap"] for r in rs]),
            "total_overlap": _mean([r["total_overlap"] for r in rs]),
            "reused_token_fraction": _mean([r["reused_token_fraction"] for r in rs]),
        }
        for p, rs in by_policy.items()
    }
    return {
        "suite": "overlap",
        "requests_per_workload": ctx.sizes.overlap_requests,
        "tokenizer": ctx.tokenizer().name,
        "block_size": 32,
        "rows": rows,
        "mean_over_workloads": mean,
        "paper": {"prefix_overlap": 0.11, "total_overlap": 0.43},
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
