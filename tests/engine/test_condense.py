"""Condense: which model replies count as a rewrite of the follow-up (the rest fall back to
the previous message + follow-up, so retrieval never follows an answer or an invention)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from craft_rag.engine.condense import _condensed, is_rewrite


@pytest.mark.parametrize(
    "reply",
    [
        "Who was Beyonce's wife?",
        "Who was the wife of Jay-Z?",
        "What did Marie Curie study",
    ],
)
def test_rewrites_that_keep_the_question_are_accepted(reply: str) -> None:
    question = "What did she study?" if "study" in reply else "Who was his wife?"
    assert is_rewrite(reply, question, "Who was Jay-Z?")


@pytest.mark.parametrize(
    "reply",
    [
        "His wife was Mary Smith, a singer.",  # invented statement
        "Beyonce.",  # an answer
        "Who was his mother?",  # changed the question (wife -> mother)
        "Who " + "really " * 40 + "was his wife?",  # far longer than question + history
        "",
    ],
)
def test_answers_inventions_and_changed_questions_are_not_rewrites(reply: str) -> None:
    assert not is_rewrite(reply, "Who was his wife?", "Who was Jay-Z?")


def _result(text: str) -> Any:
    return SimpleNamespace(text=text, report=None)


def test_a_non_rewrite_falls_back_to_the_previous_message_plus_follow_up() -> None:
    condensed = _condensed(
        _result("His wife was Mary Smith."), "Who was his wife?", "Who is Jay-Z?"
    )
    assert condensed.method == "history"
    assert condensed.question == "Who is Jay-Z? Who was his wife?"
    alone = _condensed(_result("Mary."), "Who was his wife?", None)
    assert alone.method == "none" and alone.question == "Who was his wife?"


def test_a_real_rewrite_is_used() -> None:
    condensed = _condensed(_result("Who was Jay-Z's wife?"), "Who was his wife?", "Who is Jay-Z?")
    assert condensed.method == "llm" and condensed.question == "Who was Jay-Z's wife?"
