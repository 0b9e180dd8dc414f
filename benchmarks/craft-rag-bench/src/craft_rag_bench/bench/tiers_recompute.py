"""Exactness of tier hits against a recompute of the same prompt (``--verify-tier-hits``).

The ``tiers`` suite's first exactness check (:func:`craft_rag_bench.bench.tiers.exactness`)
compares a tier system with ``craft`` on the same request, which says something only where both
planners built the same prompt; once the planner sees tier residency the tier systems order
chunks differently, and few tier hits are comparable. This check needs no second system: the
worker (:func:`craft_rag_bench.bench.tiers_worker.recompute_tier_hits`) serves each tier-hit
prompt again from scratch, and :func:`recompute_check` counts the outcomes.

A re-run counts as *verified* only when it really was from scratch: it reports 0 cached tokens
and tier counts of exactly 0 and 0 (unknown counts do not verify). A tier-hit row without a
re-run (the worker was stopped, or ran without the option) is *unverified*.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from craft_rag_bench.bench.tiers_worker import is_tier_hit

MAX_IDS = 20
"""Ids listed per kind of outcome (the counts are always complete)."""


def recompute_check(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """One system's tier hits against their from-scratch re-runs (the rows' ``recompute``):
    ``tier_hit_requests`` (rows a tier served tokens to), ``verified_requests`` (those with a
    from-scratch re-run), ``identical_to_recompute`` (verified and with the same greedy output
    ids), ``all_identical`` (every tier hit verified and identical, and at least one), and up
    to :data:`MAX_IDS` ids each of ``mismatched_ids`` (verified, different output),
    ``not_from_scratch_ids`` (the re-run reused cached or tier tokens) and ``unverified_ids``
    (no re-run). None when no row has a ``recompute`` key (the option was off). O(rows)."""
    if not any("recompute" in r for r in rows):
        return None
    hits = verified = identical = 0
    ids: dict[str, list[str]] = {"mismatched_ids": [], "not_from_scratch_ids": [],
                                 "unverified_ids": []}

    def note(kind: str, row: Mapping[str, Any]) -> None:
        if len(ids[kind]) < MAX_IDS:
            ids[kind].append(str(row["id"]))

    for row in rows:
        if not is_tier_hit(row):
            continue
        hits += 1
        again = row.get("recompute")
        if not isinstance(again, Mapping):
            note("unverified_ids", row)
            continue
        if (again.get("cached_tokens"), again.get("ram_tokens"),
                again.get("disk_tokens")) != (0, 0, 0):
            note("not_from_scratch_ids", row)
            continue
        verified += 1
        if list(again["output_ids"]) == list(row["output_ids"]):
            identical += 1
        else:
            note("mismatched_ids", row)
    return {"tier_hit_requests": hits, "verified_requests": verified,
            "identical_to_recompute": identical,
            "all_identical": hits > 0 and identical == hits, **ids}
