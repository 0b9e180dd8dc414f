"""The walk of a RAG turn through the engine's modules goes one way: fit -> layout -> plan ->
render -> submit, then (the reply in) commit -> record. Each of its two walks (start, commit)
leaves a module for good once it moves on, except the planner, which both plans and commits
(the layers target of the core redesign). Measured with a profile hook on the calls the
turn's own module (``craft_rag.engine.rag_turn``) makes; fake backend, real engine."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

from craft_rag.engine.engine import CraftEngine
from craft_rag.testing import FakeBackend, make_chunks

Factory = Callable[..., tuple[CraftEngine, FakeBackend]]
TURN_MODULE = "craft_rag.engine.rag_turn"
EXEMPT = "craft_rag.planner"  # plans, claims and commits: visited in both phases by design


def _walk(action: Callable[[], object]) -> list[tuple[str, str]]:
    """(module, function) of every craft_rag call made directly from the turn's module."""
    calls: list[tuple[str, str]] = []

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        del arg
        caller = frame.f_back
        if event != "call" or caller is None:
            return
        if caller.f_globals.get("__name__") != TURN_MODULE:
            return
        module = frame.f_globals.get("__name__", "")
        if module.startswith("craft_rag") and module != TURN_MODULE:
            calls.append((module, frame.f_code.co_name))

    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        action()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return calls


def _returns(modules: list[str]) -> list[str]:
    """Modules entered again after the walk had moved on to another (planner exempt)."""
    left: set[str] = set()
    again: list[str] = []
    previous = None
    for module in modules:
        if module != previous:
            if module in left and not module.startswith(EXEMPT):
                again.append(module)
            if previous is not None:
                left.add(previous)
            previous = module
    return again


def _phases(calls: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """Split at the commit's first step (the reply stored in the turn's history)."""
    cut = next(i for i, (_, name) in enumerate(calls) if name == "stored_turn")
    return [m for m, _ in calls[:cut]], [m for m, _ in calls[cut:]]


@pytest.mark.parametrize("salt", [None, "tenant"])
@pytest.mark.parametrize("conversation", [None, "c"])
def test_a_rag_turn_never_returns_to_a_module_it_left(
    make_fake_engine: Factory, salt: str | None, conversation: str | None
) -> None:
    engine, _ = make_fake_engine()
    chunks = make_chunks(12, words=30)
    for i in range(2):  # a conversation with history, a warm tree
        engine.generate(
            chunks[3 * i : 3 * i + 3],
            f"q{i}?",
            conversation_id=conversation,
            cache_salt=salt,
            max_tokens=4,
        )
    calls = _walk(
        lambda: engine.generate(
            chunks[4:9], "q9?", conversation_id=conversation, cache_salt=salt, max_tokens=4
        )
    )
    start, commit = _phases(calls)
    # The walk is the one the docs draw, in this order.
    assert [
        m
        for m in (
            "craft_rag.engine.turn_context",
            "craft_rag.planner.planner",
            "craft_rag.engine.conversation_prompts",
            "craft_rag.engine.driver",
        )
        if m in start
    ] == [
        "craft_rag.engine.turn_context",
        "craft_rag.planner.planner",
        "craft_rag.engine.conversation_prompts",
        "craft_rag.engine.driver",
    ]
    assert "craft_rag.planner.planner" in commit
    assert _returns(start) == [], start
    assert _returns(commit) == [], commit
    # Nothing calls back up into the facade mid-turn.
    assert "craft_rag.engine.engine" not in start + commit


def test_the_check_finds_a_return() -> None:
    """The helper the test relies on does flag a module entered again."""
    assert _returns(["a", "b", "a"]) == ["a"]
    assert _returns(["a", "a", "b", "c"]) == []
    assert _returns(["craft_rag.planner.x", "b", "craft_rag.planner.x"]) == []


def test_a_spy_put_on_the_driver_after_the_engine_was_built_sees_rag_turns(
    make_fake_engine: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn's submit step reads ``driver.submit`` at call time, as the integrations' tests
    (and any wrapper) expect when they patch the driver of a built engine."""
    engine, _ = make_fake_engine()
    driver = engine._driver
    original = driver.submit
    seen: list[tuple[int, ...]] = []

    def spy(token_ids: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(tuple(token_ids))
        return original(token_ids, *args, **kwargs)

    monkeypatch.setattr(driver, "submit", spy)
    result = engine.generate(make_chunks(3, words=10), "q?", max_tokens=4)
    assert len(seen) == 1 and result.report.prompt_tokens == len(seen[0])
