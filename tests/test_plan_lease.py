"""Plan leases (issue 12 item 2): plan -> claim -> commit | abort, release back to planned;
clear errors for every transition that is not allowed."""

from __future__ import annotations

import dataclasses

import pytest

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.planner import CraftPlanner, PlannerConfig


def chunks(*names: str) -> list[Chunk]:
    return [make_chunk(f"text of {n}", id=n) for n in names]


def planner() -> CraftPlanner:
    return CraftPlanner(PlannerConfig(), clock=lambda: 0.0)


def test_claim_by_plan_ref_and_id_returns_the_plan_as_made() -> None:
    p = planner()
    plan = p.plan(chunks("A", "B"), "c")
    assert p.claim(plan.ref) is plan
    assert p.release(plan)
    assert p.claim(plan.plan_id) is plan
    p.commit(plan)
    assert not p.is_pending(plan) and not p.in_flight("c")
    p._check_invariants()


def test_claiming_twice_is_refused_until_released() -> None:
    p = planner()
    plan = p.plan(chunks("A"))
    p.claim(plan)
    with pytest.raises(RuntimeError, match="already being served"):
        p.claim(plan.ref)
    assert p.release(plan) and not p.release(plan)  # released once: back to planned
    assert p.claim(plan) is plan


def test_commit_or_claim_after_abort_is_refused() -> None:
    p = planner()
    plan = p.plan(chunks("A"), "c")
    p.claim(plan)
    assert p.abort(plan) and not p.abort(plan)
    with pytest.raises(RuntimeError, match="already committed, aborted"):
        p.commit(plan)
    with pytest.raises(RuntimeError, match="already committed, aborted"):
        p.claim(plan.ref)
    assert not p.in_flight("c") and p.stats.commits == 0
    p.plan(chunks("B"), "c")  # the conversation may be planned again


def test_claim_unknown_or_foreign_or_malformed_plans() -> None:
    p, other = planner(), planner()
    with pytest.raises(RuntimeError, match="plan 7 was already committed, aborted, or is too old"):
        p.claim(7)
    foreign = other.plan(chunks("A"))
    with pytest.raises(RuntimeError, match="another CraftPlanner"):
        p.claim(foreign.ref)
    with pytest.raises(RuntimeError, match="another CraftPlanner"):
        p.claim(foreign)
    for bad in ("nope", "x.y", 0, -3, True, None, 1.5):
        with pytest.raises(ValueError, match=r"^plan:"):
            p.claim(bad)  # type: ignore[arg-type]
    own = p.plan(chunks("A"))
    altered = dataclasses.replace(own, turn=2)
    with pytest.raises(ValueError, match="altered after planning"):
        p.claim(altered)
    assert p.claim(own) is own  # the refused claim left the lease unclaimed


def test_a_committed_plan_cannot_be_claimed_or_released() -> None:
    p = planner()
    plan = p.plan(chunks("A"))
    p.commit(plan)
    assert not p.release(plan)
    with pytest.raises(RuntimeError, match="already committed"):
        p.claim(plan)
    assert p.committed_turns("c") == 0
    conv = p.plan(chunks("B"), "c")
    p.commit(p.claim(conv.ref))
    assert p.committed_turns("c") == 1


def test_reserve_finds_the_oldest_waiting_plan_of_those_keys_once() -> None:
    p = planner()
    first, second = p.plan(chunks("A", "B")), p.plan(chunks("A", "B"))
    assert p.waiting() == 2
    assert p.reserve(None, ["B", "A"]) is None  # another order: not these plans
    assert p.reserve(None, list(first.keys)) is first
    assert p.reserve(None, list(first.keys)) is second
    assert p.reserve(None, list(first.keys)) is None and p.waiting() == 0
    assert p.claim(first.ref) is first  # a reserved plan is claimed by its holder
    assert p.release(first) and p.waiting() == 1  # released: waiting again
    p.commit(second)
    p._check_invariants()


def test_made_and_pending_plan_name_the_maker() -> None:
    p, other = planner(), planner()
    plan = p.plan(chunks("A"))
    assert p.made(plan) and p.made(plan.ref) and not other.made(plan.ref)
    assert not p.made(plan.plan_id)  # a bare id names no maker
    assert p.pending_plan(plan.ref) is plan and other.pending_plan(plan.ref) is None
    p.abort(plan)
    assert p.made(plan) and p.pending_plan(plan) is None
