"""History budget, pre-planning fit and side prompts of conversation prompts (issue 15 item 3).

Dedup is only correct while the turn that carried a chunk is still in the prompt: whenever
turns are dropped (budget or context length), the planner must forget their chunks so a chunk
retrieved again is sent again.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from rag_turn_harness import TurnHarness

from craft_rag.engine.conversation_prompts import ConversationPrompts, HistoryBudget
from craft_rag.engine.engine import CraftEngine
from craft_rag.engine.planners import PlannerNamespaces
from craft_rag.planner import CraftPlanner
from craft_rag.prompt import PromptAssembler
from craft_rag.testing import FAKE_FORMAT, FakeBackend, make_chunks
from craft_rag.tokenizer import HashingTokenizer

Factory = Callable[..., tuple[CraftEngine, FakeBackend]]


def make_turns(
    budget: HistoryBudget | None, drops: list[tuple[str, str | None, int]]
) -> TurnHarness:
    """Turns on the planner path whose planner notes every drop of oldest turns as
    ``(conversation, salt, n)``."""
    h = TurnHarness(max_model_len=4000, history_budget=budget)
    planner = h.namespaces.default
    forget = planner.forget_turns

    def recording(conversation_id: str, n: int) -> int:
        drops.append((conversation_id, None, n))
        return forget(conversation_id, n)

    planner.forget_turns = recording  # type: ignore[method-assign]
    return h


def test_budget_values_are_checked() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        HistoryBudget(0, 0)
    with pytest.raises(ValueError, match="keep_tokens"):
        HistoryBudget(100, 101)
    with pytest.raises(ValueError, match="history_budget"):
        ConversationPrompts(
            PromptAssembler(HashingTokenizer(), FAKE_FORMAT),
            max_model_len=100,
            stores=PlannerNamespaces(CraftPlanner()),
            history_budget=(10, 5),  # type: ignore[arg-type]
        )


def test_over_budget_drops_oldest_whole_turns_down_to_keep_then_appends_again() -> None:
    drops: list[tuple[str, str | None, int]] = []
    h = make_turns(HistoryBudget(max_tokens=120, keep_tokens=60), drops)
    prompts = h.prompts
    sizes: list[int] = []
    dropped_at: list[int] = []
    for turn in range(12):
        chunks = make_chunks(1, words=8, prefix=f"t{turn}", seed=turn)
        rendered = h.serve(chunks, f"Q{turn}?", [7, 8, 9], conversation_id="c", max_tokens=4)
        if rendered.earlier_dropped:
            dropped_at.append(turn)
        sizes.append(prompts.history_tokens("c"))
        prompts._check_invariants()
        assert prompts.history_tokens("c") <= 120
    assert drops, "the budget never triggered"
    assert all(cid == "c" and salt is None and n >= 1 for cid, salt, n in drops)
    # Hysteresis: after a drop the history is at most keep_tokens, and the next turns only
    # append (the prefix stays stable) until the budget is exceeded again.
    first = dropped_at[0]
    assert sizes[first - 1] <= 60
    assert len(dropped_at) >= 2 and dropped_at[1] - dropped_at[0] >= 2
    # The prompt after a drop holds the head and then the kept turns, not the dropped ones.
    assert prompts.turn_count("c") >= 1


def test_the_newest_turn_is_kept_even_when_it_alone_exceeds_keep() -> None:
    drops: list[tuple[str, str | None, int]] = []
    h = make_turns(HistoryBudget(max_tokens=20, keep_tokens=0), drops)
    for turn in range(3):
        h.serve(
            make_chunks(1, words=30, prefix=f"t{turn}"), "Q?", [5], conversation_id="c",
            max_tokens=4,
        )
        assert h.prompts.turn_count("c") == 1
    assert [n for _, _, n in drops] == [1, 1]


def test_no_budget_keeps_everything() -> None:
    drops: list[tuple[str, str | None, int]] = []
    h = make_turns(None, drops)
    for turn in range(5):
        h.serve(
            make_chunks(1, words=30, prefix=f"t{turn}"), "Q?", [5], conversation_id="c",
            max_tokens=4,
        )
    assert h.prompts.turn_count("c") == 5 and drops == []


def test_side_prompt_continues_the_history_and_stores_nothing() -> None:
    h = make_turns(None, [])
    prompts = h.prompts
    rendered = h.serve(make_chunks(2), "Q1?", [11, 12], conversation_id="c", max_tokens=4)
    stored = prompts.history_tokens("c")
    side = prompts.side_prompt("c", "Rewrite the follow-up.")
    head = prompts.assembler.head_ids
    full = (*head, *rendered.turn_ids, 11, 12)
    assert side[: len(full)] == full
    assert side[len(head) + stored :] == prompts.assembler.question_ids("Rewrite the follow-up.")
    assert prompts.history_tokens("c") == stored and prompts.turn_count("c") == 1
    assert prompts.side_prompt(None, "x") == (*head, *prompts.assembler.question_ids("x"))
    # Another tenant's "c" is another (unknown) conversation: nothing of this one in it.
    assert prompts.side_prompt("c", "x", "other-tenant") == (
        *head, *prompts.assembler.question_ids("x")
    )
    with pytest.raises(ValueError, match="non-empty"):
        prompts.side_prompt("c", "  ")


def _contains(prompt: tuple[int, ...], part: tuple[int, ...]) -> bool:
    return any(prompt[i : i + len(part)] == part for i in range(len(prompt) - len(part) + 1))


@pytest.mark.parametrize("salt", [None, "tenant"])
def test_a_chunk_of_a_turn_dropped_by_the_budget_is_sent_again(
    make_fake_engine: Factory, salt: str | None
) -> None:
    engine, backend = make_fake_engine(FakeBackend(max_model_len=2000), history_budget=None)
    first = make_chunks(1, words=40, prefix="first")[0]
    engine.generate([first], "Q1?", conversation_id="c", max_tokens=2, cache_salt=salt)
    turn1 = engine.conversations.history_tokens("c")
    engine.conversations.history_budget = HistoryBudget(turn1 + 5, 0)
    # Still in the prompt: a repeat is deduplicated.
    other = make_chunks(1, words=60, prefix="other")[0]
    r2 = engine.generate([first, other], "Q2?", conversation_id="c", max_tokens=2, cache_salt=salt)
    assert r2.report.removed_duplicates == (first.key,)
    # Turn 2 took the history over budget: turn 1 was dropped (keep 0 keeps turn 2 only).
    assert engine.conversations.turn_count("c", salt) == 1
    r3 = engine.generate([first], "Q3?", conversation_id="c", max_tokens=2, cache_salt=salt)
    assert r3.report.removed_duplicates == ()
    assert r3.report.chunk_order == (first.key,)
    assert r3.report.dropped_turns == 1 and r3.report.turn == 3
    assert _contains(backend.added[-1][1], engine.assembler.chunk_ids(first))
    # Chunks of the kept turn are still deduplicated.
    r4 = engine.generate([first], "Q4?", conversation_id="c", max_tokens=2, cache_salt=salt)
    assert r4.report.removed_duplicates == (first.key,)
    engine.conversations._check_invariants()


def test_a_turn_that_needs_room_drops_old_turns_before_planning(make_fake_engine: Factory) -> None:
    """Context-length drops happen before the plan: the plan never removes a chunk whose turn
    the prompt is about to lose."""
    engine, backend = make_fake_engine(FakeBackend(max_model_len=300), history_budget=None)
    a, b, c = (make_chunks(1, words=45, prefix=p)[0] for p in ("a", "b", "c"))
    engine.generate([a], "Q1?", conversation_id="s", max_tokens=4)
    engine.generate([b], "Q2?", conversation_id="s", max_tokens=4)
    # a is still sent (turn 1), but turn 3 with a, b and c cannot fit with turns 1 and 2.
    r3 = engine.generate([a, b, c], "Q3?", conversation_id="s", max_tokens=4)
    prompt = backend.added[-1][1]
    assert len(prompt) + 4 <= 300
    assert r3.report.dropped_turns >= 1
    for chunk in (a, b, c):
        assert _contains(prompt, engine.assembler.chunk_ids(chunk)), chunk.key
    engine.conversations._check_invariants()


def test_a_caller_plan_relying_on_a_dropped_turn_is_refused(make_fake_engine: Factory) -> None:
    engine, backend = make_fake_engine(FakeBackend(max_model_len=300), history_budget=None)
    a, b = (make_chunks(1, words=45, prefix=p)[0] for p in ("a", "b"))
    big = make_chunks(1, words=190, prefix="big")[0]
    engine.generate([a], "Q1?", conversation_id="s", max_tokens=4)
    planner = engine.planner
    plan = planner.plan([a, big], "s")
    assert [c.key for c in plan.removed_duplicates] == [a.key]  # type: ignore[attr-defined]
    sent = len(backend.added)
    with pytest.raises(RuntimeError, match="fit_turn"):
        engine.generate([a, big], "Q2?", conversation_id="s", plan=plan, max_tokens=4)
    assert len(backend.added) == sent
    abort = getattr(planner, "abort", None)
    if callable(abort):  # the refused plan will not be served
        abort(plan)
    # The documented fix: fit first, then plan: a is planned as new again.
    engine.fit_turn([a, b], "Q2?", conversation_id="s", max_tokens=4)
    again = planner.plan([a, b], "s")
    assert again.removed_duplicates == ()  # type: ignore[attr-defined]


def test_stress_budget_keeps_every_retrieved_chunk_in_the_prompt(make_fake_engine: Factory) -> None:
    """Seeded random conversations: every turn's prompt holds every retrieved chunk (in this
    turn's segment or in a kept earlier turn)."""
    rng = random.Random(7)
    engine, backend = make_fake_engine(
        FakeBackend(max_model_len=600), history_budget=HistoryBudget(260, 120)
    )
    pool = make_chunks(12, words=20)
    for step in range(60):
        picked = rng.sample(pool, rng.randint(1, 4))
        cid = f"c{step % 3}"
        engine.generate(picked, f"Q{step}?", conversation_id=cid, max_tokens=3)
        prompt = backend.added[-1][1]
        for chunk in picked:
            assert _contains(prompt, engine.assembler.chunk_ids(chunk)), (step, chunk.key)
        engine.conversations._check_invariants()
        planner = engine.planner
        planner._check_invariants()  # type: ignore[attr-defined]
