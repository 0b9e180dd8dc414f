"""ConversationPrompts: append-only histories, whole-turn dropping, bounds; seeded stress."""

from __future__ import annotations

import random

import pytest

from craft_rag.engine.conversation_prompts import ConversationPrompts
from craft_rag.prompt import PromptAssembler
from craft_rag.testing import FAKE_FORMAT, make_chunks
from craft_rag.tokenizer import HashingTokenizer


def make_prompts(max_model_len: int = 400, max_conversations: int = 8) -> ConversationPrompts:
    return ConversationPrompts(
        PromptAssembler(HashingTokenizer(), FAKE_FORMAT),
        max_model_len=max_model_len,
        max_conversations=max_conversations,
    )


def test_turns_append_and_stop_tokens_are_replaced_by_the_close() -> None:
    cp = make_prompts()
    first = cp.render(make_chunks(2), "Q1?", max_tokens=8, conversation_id="c")
    cp.complete(first, [11, 12, 2, 2], stop_token_ids=frozenset({2}))
    second = cp.render(make_chunks(1, prefix="n"), "Q2?", max_tokens=8, conversation_id="c")
    close = cp.assembler.answer_ids("")
    assert second.prompt.token_ids[: second.prompt.prefix_tokens] == (
        *first.prompt.token_ids, 11, 12, *close
    )
    assert second.kept_turns == 1 and second.dropped_turns == 0


def test_single_turn_requests_keep_no_history() -> None:
    cp = make_prompts()
    rendered = cp.render(make_chunks(2), "Q?", max_tokens=4)
    cp.complete(rendered, [1, 2])
    assert rendered.prompt.prefix_tokens == len(cp.assembler.head_ids)
    assert cp.turn_count("anything") == 0


def test_fresh_restarts_and_cancel_keeps_history() -> None:
    cp = make_prompts()
    t1 = cp.render(make_chunks(1), "Q1?", max_tokens=4, conversation_id="c")
    cp.complete(t1, [5])
    t2 = cp.render(make_chunks(1, prefix="x"), "Q2?", max_tokens=4, conversation_id="c")
    cp.cancel(t2)
    assert cp.turn_count("c") == 1
    again = cp.render([], "Q?", max_tokens=4, conversation_id="c", fresh=True)
    assert again.kept_turns == 0 and again.prompt.prefix_tokens == len(cp.assembler.head_ids)


def test_too_long_alone_is_a_value_error_naming_the_fixes() -> None:
    cp = make_prompts(max_model_len=100)
    with pytest.raises(ValueError, match=r"fewer or shorter chunks, lower max_tokens"):
        cp.render(make_chunks(5, words=30), "Q?", max_tokens=10, conversation_id="c")
    # Nothing was marked in flight.
    cp.render([], "Q?", max_tokens=10, conversation_id="c")


def test_seeded_stress_keeps_invariants() -> None:
    rng = random.Random(1234)
    cp = make_prompts(max_model_len=300, max_conversations=4)
    pending = {}
    for step in range(600):
        cid = f"c{rng.randrange(7)}"
        action = rng.random()
        if cid in pending:
            rendered = pending.pop(cid)
            if action < 0.8:
                cp.complete(rendered, [rng.randrange(50) for _ in range(rng.randrange(8))])
            else:
                cp.cancel(rendered)
        elif action < 0.05:
            cp.end(cid)
        else:
            chunks = make_chunks(rng.randrange(4), words=rng.randrange(5, 25), seed=step,
                                 prefix=f"s{step}")
            try:
                rendered = cp.render(chunks, f"Q{step}?", max_tokens=8, conversation_id=cid,
                                     fresh=rng.random() < 0.05)
            except ValueError:
                continue
            prompt = rendered.prompt
            assert prompt.num_tokens + 8 <= 300
            assert prompt.token_ids[: len(cp.assembler.head_ids)] == cp.assembler.head_ids
            for chunk, (start, end) in zip(chunks, prompt.chunk_spans, strict=True):
                assert prompt.token_ids[start:end] == cp.assembler.chunk_ids(chunk)
            pending[cid] = rendered
        cp._check_invariants()


def test_a_conversation_is_scoped_by_its_salt() -> None:
    """The same id under two salts is two conversations: each renders, counts and ends its
    own turns; nothing tells one salt that the other uses the id."""
    cp = make_prompts()
    first = cp.render(make_chunks(1), "Q1?", max_tokens=4, conversation_id="c", cache_salt="a")
    cp.complete(first, [5])
    assert (cp.turn_count("c", "a"), cp.turn_count("c", "b"), cp.turn_count("c")) == (1, 0, 0)
    for other in ("b", None):
        fresh = cp.render([], "Q?", max_tokens=4, conversation_id="c", cache_salt=other)
        assert fresh.kept_turns == 0 and fresh.prompt.token_ids == first.prompt.token_ids[
            : len(cp.chat_assembler.head_ids)
        ] + fresh.turn_ids
        cp.complete(fresh, [6])
    second = cp.render([], "Q2?", max_tokens=4, conversation_id="c", cache_salt="a")
    assert second.kept_turns == 1
    cp.cancel(second)
    assert cp.end("c", "b") and not cp.end("c", "b")
    assert (cp.turn_count("c", "a"), cp.turn_count("c", "b"), cp.turn_count("c")) == (1, 0, 1)
    assert cp.end("c") and cp.turn_count("c", "a") == 1
    assert not cp.end("c", "never-used")


def test_evicted_or_ended_conversations_are_forgotten_with_their_salt() -> None:
    """One store per salt, LRU-bounded: the least recently used conversation of a salt is
    forgotten (turns and salt), an ended one too; a turn in flight is never evicted."""
    cp = make_prompts(max_conversations=2)
    for cid in ("a", "b", "c"):
        cp.complete(cp.render([], "Q?", max_tokens=8, conversation_id=cid, cache_salt="s"), [5])
    assert cp.turn_count("a", "s") == 0  # the least recently used
    assert cp.turn_count("b", "s") == 1
    assert cp.end("b", "s") and not cp.end("b", "s")
    assert cp.turn_count("b", "s") == 0
    held = cp.render([], "Q?", max_tokens=8, conversation_id="d", cache_salt="s")
    for cid in ("e", "f"):
        cp.complete(cp.render([], "Q?", max_tokens=8, conversation_id=cid, cache_salt="s"), [5])
    cp.complete(held, [5])  # "d" was in flight: kept past the bound, then recorded
    assert cp.turn_count("d", "s") == 1
    cp._check_invariants()
    cp.clear()
    assert cp.turn_count("d") == 0
