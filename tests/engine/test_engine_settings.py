"""``CraftEngine``'s grouped options (craft_rag.engine.engine_settings): each flat keyword is one
group's field, a group and the flat keywords give the same engine, and mixing them for one group
is refused."""

from __future__ import annotations

from dataclasses import fields

import pytest

from craft_rag.engine.chat_format import jinja_renderer
from craft_rag.engine.engine import CraftEngine
from craft_rag.engine.engine_settings import (
    FLAT_KEYWORDS,
    BackendParts,
    ConversationSettings,
    EngineParts,
    FlatKeywords,
    PlannerSettings,
    RenderingSettings,
    group_keywords,
)
from craft_rag.engine.turn_layout import APPEND_ONLY
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.testing import CHATML, FAKE_FORMAT, FakeBackend, make_chunks
from craft_rag.tokenizer import HashingTokenizer

GROUPS = {
    "planners": PlannerSettings,
    "rendering": RenderingSettings,
    "conversation": ConversationSettings,
    "parts": BackendParts,
}


def test_every_flat_keyword_is_exactly_one_groups_field() -> None:
    by_fields = {f.name: group for group, cls in GROUPS.items() for f in fields(cls)}
    assert dict(FLAT_KEYWORDS) == by_fields
    assert FlatKeywords.__optional_keys__ == set(by_fields) and not FlatKeywords.__required_keys__
    assert [f.name for f in fields(EngineParts)] == list(GROUPS)


def test_flat_keywords_fold_into_their_groups_and_defaults_fill_the_rest() -> None:
    parts = group_keywords(
        None,
        None,
        None,
        None,
        {"store": "memory://", "system_prompt": "S", "turn_layout": APPEND_ONLY},
    )
    assert parts.planners == PlannerSettings(store="memory://")
    assert parts.rendering == RenderingSettings(system_prompt="S")
    assert parts.conversation == ConversationSettings(turn_layout=APPEND_ONLY)
    assert parts.parts == BackendParts()
    given = RenderingSettings(instructions="I")
    assert group_keywords(None, given, None, None, {}).rendering is given


def test_a_group_and_its_own_keyword_together_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^system_prompt and rendering= both given; pass it"):
        group_keywords(None, RenderingSettings(), None, None, {"system_prompt": "S"})
    # A keyword of another group is fine.
    parts = group_keywords(None, RenderingSettings(system_prompt="S"), None, None, {"store": "x"})
    assert parts.planners.store == "x" and parts.rendering.system_prompt == "S"


def test_unknown_keywords_and_wrong_group_types_name_the_valid_ones() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['stor'\]; valid: .*store"):
        group_keywords(None, None, None, None, {"stor": "memory://"})
    with pytest.raises(ValueError, match=r"^planners must be a PlannerSettings, not dict"):
        group_keywords({"store": "x"}, None, None, None, {})  # type: ignore[arg-type]


def _engines(backend_a: FakeBackend, backend_b: FakeBackend) -> tuple[CraftEngine, CraftEngine]:
    flat = CraftEngine(
        planner=CraftPlanner(PlannerConfig(policy="tree")),
        backend=backend_a,
        tokenizer=HashingTokenizer(),
        prompt_format=FAKE_FORMAT,
        block_hasher=backend_a.block_hasher,
        chat_renderer=jinja_renderer(CHATML),
        system_prompt="SYSTEM",
        max_conversations=7,
        turn_layout=APPEND_ONLY,
    )
    grouped = CraftEngine(
        planner=CraftPlanner(PlannerConfig(policy="tree")),
        planners=PlannerSettings(max_conversations=7),
        rendering=RenderingSettings(prompt_format=FAKE_FORMAT, system_prompt="SYSTEM"),
        conversation=ConversationSettings(turn_layout=APPEND_ONLY),
        parts=BackendParts(
            backend=backend_b,
            tokenizer=HashingTokenizer(),
            block_hasher=backend_b.block_hasher,
            chat_renderer=jinja_renderer(CHATML),
        ),
    )
    return flat, grouped


def test_groups_and_flat_keywords_build_the_same_engine() -> None:
    backend_a, backend_b = FakeBackend(), FakeBackend()
    flat, grouped = _engines(backend_a, backend_b)
    try:
        for engine in (flat, grouped):
            assert engine.system_prompt == "SYSTEM" and engine.prompt_format is FAKE_FORMAT
            assert engine.planner.config.max_conversations == 7
            chunks = make_chunks(3)
            engine.generate(chunks, "q1?", max_tokens=2, conversation_id="c")
            engine.generate(chunks[:2], "q2?", max_tokens=2, conversation_id="c")
        assert [ids for _, ids, _ in backend_a.added] == [ids for _, ids, _ in backend_b.added]
        assert len(backend_a.added) == 2
    finally:
        flat.close()
        grouped.close()
