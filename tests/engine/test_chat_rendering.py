"""The rendering per path (issue 15): single requests keep the single-turn format, conversation
turns use the chat format (the question as its own user message where the template allows);
explicit formats win. Unit level: template folders and the fake engine."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from rag_turn_harness import TurnHarness

from craft_rag.engine.chat_format import derive_chat_format
from craft_rag.engine.engine import CraftEngine
from craft_rag.engine.wiring import conversation_format
from craft_rag.prompt import DEFAULT_INSTRUCTIONS, PromptAssembler, PromptFormat
from craft_rag.testing import (
    ALTERNATING_TEMPLATE,
    CHATML,
    FAKE_FORMAT,
    MERGING_TEMPLATE,
    FakeBackend,
    make_chunks,
)
from craft_rag.tokenizer import HashingTokenizer

ALTERNATING = ALTERNATING_TEMPLATE
MERGING = MERGING_TEMPLATE
# The fake engine's format with the question as its own "user message" (</u><u> between).
CHAT_FORMAT = replace(FAKE_FORMAT, question=" </u><u>{question}")

MakeEngine = Callable[..., tuple[CraftEngine, FakeBackend]]


def template_dir(tmp_path: Path, template: str) -> str:
    (tmp_path / "chat_template.jinja").write_text(template, encoding="utf-8")
    return str(tmp_path)


def choose(folder: str, **given: PromptFormat | None) -> tuple[PromptFormat, str, PromptFormat]:
    single = given.get("prompt_format") or derive_chat_format(folder)
    choice = conversation_format(
        folder,
        single,
        prompt_format=given.get("prompt_format"),
        chat_prompt_format=given.get("chat_prompt_format"),
        system_prompt=None,
        instructions=DEFAULT_INSTRUCTIONS,
    )
    return choice.format, choice.rendering, single


def test_a_template_accepting_two_user_messages_gets_question_messages(tmp_path: Path) -> None:
    folder = template_dir(tmp_path, CHATML)
    chat, rendering, single = choose(folder)
    assert rendering == "question_message"
    assert chat == derive_chat_format(folder, question_message=True)
    assert chat.question == "<|im_end|>\n<|im_start|>user\n{question}"
    assert single.question == "Question: {question}"  # single requests: unchanged
    # Only the question piece differs: head and chunks (the reusable prefix) are shared.
    same = ("head", "chunk", "tail", "answer")
    assert [getattr(chat, f) for f in same] == [getattr(single, f) for f in same]


@pytest.mark.parametrize(
    ("template", "why"), [(ALTERNATING_TEMPLATE, "refuses"), (MERGING_TEMPLATE, "merges")]
)
def test_templates_refusing_two_user_messages_fall_back_and_say_so(
    tmp_path: Path, template: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    folder = template_dir(tmp_path, template)
    with caplog.at_level(logging.INFO, logger="craft_rag.engine"):
        chat, rendering, single = choose(folder)
    assert rendering == "single_turn"
    assert chat is single
    logged = [r for r in caplog.records if r.name == "craft_rag.engine"]
    assert len(logged) == 1
    assert "single-turn rendering" in logged[0].getMessage()
    assert f"{why} two user messages in a row" in logged[0].getMessage()


def test_explicit_formats_win(tmp_path: Path) -> None:
    folder = template_dir(tmp_path, CHATML)
    chat, rendering, single = choose(folder, prompt_format=FAKE_FORMAT)
    assert (chat, rendering) == (FAKE_FORMAT, "prompt_format") and single is FAKE_FORMAT
    chat, rendering, _ = choose(folder, chat_prompt_format=CHAT_FORMAT)
    assert (chat, rendering) == (CHAT_FORMAT, "chat_prompt_format")
    chat, rendering, single = choose(folder, prompt_format=FAKE_FORMAT,
                                     chat_prompt_format=CHAT_FORMAT)
    assert (chat, rendering, single) == (CHAT_FORMAT, "chat_prompt_format", FAKE_FORMAT)


@pytest.mark.parametrize("name", ["prompt_format", "chat_prompt_format"])
@pytest.mark.parametrize("bad", ["Question: {question}", {"question": "{question}"}, 3])
def test_formats_that_are_not_prompt_formats_are_refused_naming_the_field(
    make_fake_engine: MakeEngine, name: str, bad: object
) -> None:
    backend = FakeBackend()
    kwargs: dict[str, object] = {"prompt_format": FAKE_FORMAT, name: bad}
    with pytest.raises(ValueError, match=rf"^{name} must be a craft_rag.prompt.PromptFormat"):
        CraftEngine(backend=backend, tokenizer=HashingTokenizer(), **kwargs)  # type: ignore[arg-type]
    assert backend.added == [] and not backend.shut_down


def test_the_fake_engine_renders_each_path_with_its_format(make_fake_engine: MakeEngine) -> None:
    engine, backend = make_fake_engine(chat_prompt_format=CHAT_FORMAT)
    assert engine.chat_rendering == "chat_prompt_format"
    assert engine.chat_prompt_format is CHAT_FORMAT and engine.prompt_format is FAKE_FORMAT
    single = PromptAssembler(HashingTokenizer(), FAKE_FORMAT)
    chat = PromptAssembler(HashingTokenizer(), CHAT_FORMAT)
    chunks = make_chunks(6)

    r = engine.generate(chunks[:2], "single?", max_tokens=4)
    ordered = [c for k in r.report.chunk_order for c in chunks if c.key == k]
    assert r.prompt_token_ids == single.single_turn(ordered, "single?").token_ids
    assert backend.added[-1][1] == r.prompt_token_ids  # what the backend was sent

    prompts: list[tuple[int, ...]] = []
    replies: list[tuple[int, ...]] = []
    for turn, (picked, question) in enumerate(
        [(chunks[:3], "first?"), ([chunks[2], chunks[3]], "second?"), (chunks[4:], "third?")],
        start=1,
    ):
        r = engine.generate(picked, question, conversation_id="c", max_tokens=4)
        assert r.report.turn == turn
        ids = r.prompt_token_ids
        assert ids[-len(chat.question_ids(question)):] == chat.question_ids(question)
        assert single.question_ids(question) != chat.question_ids(question)
        if prompts:  # append-only: the previous prompt, its reply and the close lead this one
            history = (*prompts[-1], *replies[-1], *chat.answer_ids(""))
            assert ids[: len(history)] == history
            assert r.report.prefix_tokens >= len(history)
        prompts.append(ids)
        replies.append(r.token_ids)
        if turn == 2:  # dedup is unchanged: the chunk sent in turn 1 is not sent again
            assert r.report.removed_duplicates == (chunks[2].key,)
    # The side prompt (condense) continues the conversation's prompt in its format.
    side = engine.side_prompt_ids("c", "rewrite it")
    history = (*prompts[-1], *replies[-1], *chat.answer_ids(""))
    assert side == (*history, *chat.question_ids("rewrite it"))


def test_an_engine_given_only_prompt_format_uses_it_for_conversations(
    make_fake_engine: MakeEngine,
) -> None:
    engine, _ = make_fake_engine()
    assert engine.chat_rendering == "prompt_format"
    assert engine.chat_prompt_format is engine.prompt_format is FAKE_FORMAT
    assert engine.conversations.chat_assembler is engine.assembler  # one chunk cache
    r = engine.generate(make_chunks(2), "q?", conversation_id="c", max_tokens=4)
    assert r.prompt_token_ids[-len(engine.assembler.question_ids("q?")):] == (
        engine.assembler.question_ids("q?")
    )


def test_conversation_prompts_count_and_fit_with_the_chat_assembler() -> None:
    tok = HashingTokenizer()
    longer = "<s>SYS. A longer head, for conversations only: answer from the documents.\n"
    chat_format = replace(CHAT_FORMAT, head=longer)
    h = TurnHarness(chat_format=chat_format)
    cp = h.prompts
    chunks = make_chunks(2)
    single_n = cp.turn_token_count(chunks, "q?")
    chat_n = cp.turn_token_count(chunks, "q?", "c")
    assert chat_n - single_n == len(tok.encode(" </u><u>")) - len(tok.encode("Q: "))
    alone = h.serve(chunks, "q?", [7, 8], max_tokens=4)
    turn = h.serve(chunks, "q?", [7, 8], conversation_id="c", max_tokens=4)
    assert alone.prompt.prefix_tokens == len(cp.assembler.head_ids)
    heads = len(cp.chat_assembler.head_ids), len(cp.assembler.head_ids)
    assert turn.prompt.prefix_tokens == heads[0] != heads[1]
    assert len(turn.turn_ids) == chat_n
    # fit counts the chat head: with room for exactly head + history + turn nothing drops.
    room = 400 - len(cp.chat_assembler.head_ids) - cp.history_tokens("c") - chat_n
    assert h.turns.fit_turn(chunks, "q?", ("c", room, None)) == frozenset()
    assert h.turns.fit_turn(chunks, "q?", ("c", room + 1, None)) == frozenset(
        c.key for c in chunks
    )
