"""ConversationPrompts on the planner path (RagTurns: plan -> render -> commit): append-only
histories, whole-turn dropping, bounds; seeded stress."""

from __future__ import annotations

import random
import warnings

import pytest
from rag_turn_harness import TurnHarness, rag_turn, rendered

from craft_rag.engine import conversation_prompts
from craft_rag.engine.planners import ENGINE_MAX_CONVERSATIONS
from craft_rag.engine.requests import InFlight
from craft_rag.testing import make_chunks


def test_turns_append_and_stop_tokens_are_replaced_by_the_close() -> None:
    h = TurnHarness(eos_token_ids=frozenset({2}))
    first = h.serve(make_chunks(2), "Q1?", [11, 12, 2, 2], conversation_id="c")
    second = h.serve(make_chunks(1, prefix="n"), "Q2?", [5], conversation_id="c")
    close = h.prompts.assembler.answer_ids("")
    assert second.prompt.token_ids[: second.prompt.prefix_tokens] == (
        *first.prompt.token_ids, 11, 12, *close
    )
    assert second.kept_turns == 1 and second.dropped_turns == 0


def test_single_turn_requests_keep_no_history() -> None:
    h = TurnHarness()
    single = h.serve(make_chunks(2), "Q?", [1, 2], max_tokens=4)
    assert single.prompt.prefix_tokens == len(h.prompts.assembler.head_ids)
    assert h.prompts.turn_count("anything") == 0


def test_a_turn_given_up_keeps_the_history_and_an_ended_one_starts_over() -> None:
    h = TurnHarness()
    h.serve(make_chunks(1), "Q1?", [5], conversation_id="c", max_tokens=4)
    t2 = h.start(make_chunks(1, prefix="x"), "Q2?", conversation_id="c", max_tokens=4)
    rag_turn(t2).give_up()
    assert h.prompts.turn_count("c") == 1
    again = h.serve([], "Q?", [6], conversation_id="c", max_tokens=4)
    assert again.kept_turns == 1
    assert h.prompts.end("c")
    fresh = h.serve([], "Q?", [6], conversation_id="c", max_tokens=4)
    assert fresh.kept_turns == 0
    assert fresh.prompt.prefix_tokens == len(h.prompts.assembler.head_ids)


def test_too_long_alone_is_a_value_error_naming_the_fixes() -> None:
    h = TurnHarness(max_model_len=100)
    with pytest.raises(ValueError, match=r"fewer or shorter chunks, lower max_tokens"):
        h.start(make_chunks(5, words=30), "Q?", conversation_id="c", max_tokens=10)
    # Nothing was left in flight: the plan was aborted.
    h.serve([], "Q?", [5], conversation_id="c", max_tokens=10)
    assert h.prompts.turn_count("c") == 1


def test_seeded_stress_keeps_invariants() -> None:
    rng = random.Random(1234)
    h = TurnHarness(max_model_len=300, max_conversations=4)
    head = h.prompts.assembler.head_ids
    pending: dict[str, InFlight] = {}
    for step in range(600):
        cid = f"c{rng.randrange(7)}"
        action = rng.random()
        if cid in pending:
            flight = pending.pop(cid)
            if action < 0.8:
                h.finish(flight, [rng.randrange(50) for _ in range(rng.randrange(8))])
            else:
                rag_turn(flight).give_up()
        elif action < 0.05:
            h.prompts.end(cid)
        else:
            chunks = make_chunks(rng.randrange(4), words=rng.randrange(5, 25), seed=step,
                                 prefix=f"s{step}")
            try:
                flight = h.start(chunks, f"Q{step}?", conversation_id=cid, max_tokens=8)
            except ValueError:
                continue
            prompt = rendered(flight).prompt
            assert prompt.num_tokens + 8 <= 300
            assert prompt.token_ids[: len(head)] == head
            by_key = {c.key: c for c in chunks}
            assert sorted(prompt.chunk_keys) == sorted(by_key)
            for key, (start, end) in zip(prompt.chunk_keys, prompt.chunk_spans, strict=True):
                assert prompt.token_ids[start:end] == h.prompts.assembler.chunk_ids(by_key[key])
            pending[cid] = flight
        h.prompts._check_invariants()
        h.namespaces.default._check_invariants()


def test_a_conversation_is_scoped_by_its_salt() -> None:
    """The same id under two salts is two conversations: each renders, counts and ends its
    own turns; nothing tells one salt that the other uses the id."""
    h = TurnHarness()
    cp = h.prompts
    first = h.serve(make_chunks(1), "Q1?", [5], conversation_id="c", cache_salt="a")
    assert (cp.turn_count("c", "a"), cp.turn_count("c", "b"), cp.turn_count("c")) == (1, 0, 0)
    for other in ("b", None):
        fresh = h.serve([], "Q?", [6], conversation_id="c", cache_salt=other)
        assert fresh.kept_turns == 0 and fresh.prompt.token_ids == first.prompt.token_ids[
            : len(cp.chat_assembler.head_ids)
        ] + fresh.turn_ids
    second = h.start([], "Q2?", conversation_id="c", cache_salt="a")
    assert rendered(second).kept_turns == 1
    rag_turn(second).give_up()
    assert cp.end("c", "b") and not cp.end("c", "b")
    assert (cp.turn_count("c", "a"), cp.turn_count("c", "b"), cp.turn_count("c")) == (1, 0, 1)
    assert cp.end("c") and cp.turn_count("c", "a") == 1
    assert not cp.end("c", "never-used")


def test_evicted_or_ended_conversations_are_forgotten_with_their_salt() -> None:
    """One store per salt, LRU-bounded: the least recently used conversation of a salt is
    forgotten (turns and salt), an ended one too; a turn in flight is never evicted."""
    h = TurnHarness(max_conversations=2)
    cp = h.prompts
    for cid in ("a", "b", "c"):
        h.serve([], "Q?", [5], conversation_id=cid, cache_salt="s")
    assert cp.turn_count("a", "s") == 0  # the least recently used
    assert cp.turn_count("b", "s") == 1
    assert cp.end("b", "s") and not cp.end("b", "s")
    assert cp.turn_count("b", "s") == 0
    held = h.start([], "Q?", conversation_id="d", cache_salt="s")
    for cid in ("e", "f"):
        h.serve([], "Q?", [5], conversation_id=cid, cache_salt="s")
    h.finish(held, [5])  # "d" was in flight: kept past the bound, then recorded
    assert cp.turn_count("d", "s") == 1
    cp._check_invariants()
    cp.clear()
    assert cp.turn_count("d", "s") == 0


def test_the_engine_bound_has_one_name_and_the_former_one_warns() -> None:
    """ENGINE_MAX_CONVERSATIONS is an engine's default planner bound (1,024), lower than a
    planner's own (craft_rag.conversation.DEFAULT_MAX_CONVERSATIONS, 10,000); the renderer
    module's former name for it still answers, with a DeprecationWarning."""
    from craft_rag.conversation import DEFAULT_MAX_CONVERSATIONS

    assert conversation_prompts.ENGINE_MAX_CONVERSATIONS is ENGINE_MAX_CONVERSATIONS == 1024
    assert DEFAULT_MAX_CONVERSATIONS == 10_000
    with pytest.warns(DeprecationWarning, match="ENGINE_MAX_CONVERSATIONS"):
        assert conversation_prompts.DEFAULT_MAX_CONVERSATIONS == ENGINE_MAX_CONVERSATIONS
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no_such_name"):
            _ = conversation_prompts.no_such_name  # type: ignore[attr-defined]
