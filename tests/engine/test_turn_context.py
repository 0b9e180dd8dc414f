"""TurnContext: one RAG turn reads its conversation once (fit, layout, render and the history
budget all work on that view); a conversation that moved while the turn was planned is read
again. Fake engine (real CraftEngine, planner and renderer over the fake backend)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from craft_rag.conversation import ConversationHistory, ConversationStore
from craft_rag.engine.engine import CraftEngine
from craft_rag.engine.history_budget import HistoryBudget
from craft_rag.engine.planners import PlannerNamespaces
from craft_rag.engine.turn_context import TurnContext
from craft_rag.testing import FakeBackend, make_chunks
from craft_rag.types import ConversationId

Factory = Callable[..., tuple[CraftEngine, FakeBackend]]


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts conversation-store reads (``history``) and salt look-ups (PlannerNamespaces)
    while armed."""
    counts = {"history": 0, "lookups": 0, "armed": 0}
    history = ConversationStore.history

    def counting_history(self: ConversationStore, cid: ConversationId) -> Any:
        counts["history"] += counts["armed"]
        return history(self, cid)

    monkeypatch.setattr(ConversationStore, "history", counting_history)
    for name in ("get", "peek", "held_store", "conversation_stores"):
        original = getattr(PlannerNamespaces, name)

        def counting(self: Any, *a: Any, _original: Any = original) -> Any:
            counts["lookups"] += counts["armed"]
            return _original(self, *a)

        monkeypatch.setattr(PlannerNamespaces, name, counting)
    yield counts


@pytest.mark.parametrize("salt", [None, "tenant"])
@pytest.mark.parametrize("budget", [None, HistoryBudget(200, 100)])
def test_a_turn_reads_its_conversation_once_and_scans_no_store(
    make_fake_engine: Factory, reads: dict[str, int], salt: str | None, budget: HistoryBudget | None
) -> None:
    engine, _ = make_fake_engine(history_budget=budget)
    chunks = make_chunks(12, words=30)
    for other in ("x", "y"):
        engine.generate(chunks[:2], "q?", conversation_id="c", cache_salt=other, max_tokens=4)
    for i in range(3):
        engine.generate(chunks[3 * i : 3 * i + 3], f"q{i}?", conversation_id="c",
                        cache_salt=salt, max_tokens=4)
    reads["armed"] = 1
    result = engine.generate(chunks[9:], "q9?", conversation_id="c", cache_salt=salt,
                             max_tokens=4)
    reads["armed"] = 0
    assert result.report.turn == 4
    assert (budget is not None) == (result.report.dropped_turns > 0 or
                                    engine.prompt_renderer.turn_count("c", salt) < 4)
    assert reads["history"] == 1  # the TurnContext (was 5: fit, layout, render x2, settle)
    assert reads["lookups"] == 1  # the salt's planner (was 11)


def test_a_conversation_ended_while_its_turn_was_planned_is_read_again(
    make_fake_engine: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The view said turn 3; the plan (after an end) says turn 1: the turn renders what the
    store holds then (a first turn), as it did before the view existed."""
    engine, _ = make_fake_engine()
    chunks = make_chunks(4)
    for i in range(2):
        engine.generate(chunks[i : i + 1], f"q{i}?", conversation_id="c", max_tokens=4)
    planner = engine.planner
    plan = planner.plan

    def ending_plan(*args: Any, **kwargs: Any) -> Any:
        planner.end_conversation("c")
        return plan(*args, **kwargs)

    monkeypatch.setattr(planner, "plan", ending_plan)
    again = monkeypatch.context()
    opened: list[TurnContext] = []
    read_again = TurnContext.read_again

    def noting(self: TurnContext) -> TurnContext:
        view = read_again(self)
        opened.append(view)
        return view

    with again as m:
        m.setattr(TurnContext, "read_again", noting)
        result = engine.generate(chunks[2:3], "q2?", conversation_id="c", max_tokens=4)
    assert len(opened) == 1 and opened[0].next_turn == 1
    assert result.report.turn == 1 and result.report.dropped_turns == 0
    head = len(engine.prompt_renderer.chat_assembler.head_ids)
    assert result.report.prefix_tokens == head
    assert engine.prompt_renderer.turn_count("c") == 1


def test_fit_derives_the_view_after_its_drop_without_reading_again(
    make_fake_engine: Factory,
) -> None:
    engine, _ = make_fake_engine(FakeBackend(max_model_len=300), history_budget=None)
    a, b, c = (make_chunks(1, words=45, prefix=p)[0] for p in ("a", "b", "c"))
    engine.generate([a], "Q1?", conversation_id="s", max_tokens=4)
    engine.generate([b], "Q2?", conversation_id="s", max_tokens=4)
    view = TurnContext.open(
        engine.prompt_renderer, engine.planner, "s", None, [a, b, c], "Q3?", max_tokens=4
    )
    stored = engine.planner.conversations.history(ConversationId("s"))
    assert isinstance(stored, ConversationHistory) and view.history is not None
    assert view.dropped_to_fit >= 1 and view.lost_keys == {a.key}
    assert view.history.turns == stored.turns and view.history.keys == stored.keys
    assert view.history.dropped_since == stored.dropped_since == view.dropped_to_fit
    assert view.next_turn == 3


def test_history_budget_turns_to_drop_is_exact() -> None:
    budget = HistoryBudget(max_tokens=100, keep_tokens=50)
    assert budget.turns_to_drop([40, 40, 20]) == 0  # within max_tokens
    assert budget.turns_to_drop([40, 40, 30]) == 2  # 110 > 100: down to <= 50 (30)
    assert budget.turns_to_drop([10, 200]) == 1  # the newest is kept even over keep
    assert budget.turns_to_drop([10, 20, 30], first=1) == 1  # at least what was left out
    assert budget.turns_to_drop([90, 90, 90], first=2) == 2


def test_the_engine_names_its_renderer_and_keeps_the_former_name(
    make_fake_engine: Factory,
) -> None:
    """``engine.prompt_renderer`` renders prompts; the planner's ``conversations`` is the state.
    ``engine.conversations`` (the former name) is the same renderer."""
    engine, _ = make_fake_engine()
    assert engine.conversations is engine.prompt_renderer
    assert engine.prompt_renderer.stores is not engine.planner.conversations
    engine.generate(make_chunks(1), "q?", conversation_id="c", max_tokens=2)
    assert engine.prompt_renderer.turn_count("c") == len(engine.planner.conversations.turns(
        ConversationId("c")
    )) == 1
