"""Moved to craft_rag.planner.plans; alias kept for one release."""

from craft_rag.planner.plans import (
    CommitResult,
    Hashes,
    Plan,
    PlannerConfig,
    PlannerStats,
    Spans,
    check_tokens,
    commit_metadata,
    commit_spans,
    config_from_json,
    made_plan,
    made_result,
    node_metadata,
    parse_plan_ref,
    span_pairs,
    split_repeats,
)

__all__ = [
    "CommitResult",
    "Hashes",
    "Plan",
    "PlannerConfig",
    "PlannerStats",
    "Spans",
    "check_tokens",
    "commit_metadata",
    "commit_spans",
    "config_from_json",
    "made_plan",
    "made_result",
    "node_metadata",
    "parse_plan_ref",
    "span_pairs",
    "split_repeats",
]
