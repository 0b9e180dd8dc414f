"""Moving a conversation between stores (``ConversationStore.import_history``, what a routed
engine does when a replica is lost): the moved conversation goes on (turn numbers, token
history, dedup, dropped turns), refusals leave both sides as they were, bad input is refused,
and the router predicts nothing cached for a carried history's first turn on its new home."""

from __future__ import annotations

from dataclasses import replace

import pytest

from craft_rag.chunk import make_chunk
from craft_rag.conversation import ConversationHistory, ConversationStore
from craft_rag.routing import Router, RouterConfig
from craft_rag.types import ChunkKey, ConversationId

C = ConversationId("c")


def filled() -> ConversationStore:
    store = ConversationStore()
    store.record_turn(C, [ChunkKey("a"), ChunkKey("b")], [1, 2, 3])
    store.record_turn(C, [ChunkKey("c")], [4, 5])
    store.record_turn(C, [ChunkKey("a"), ChunkKey("d")], [6])
    assert store.forget_oldest_turns(C, 1) == 1
    return store


def test_a_moved_conversation_goes_on_in_its_new_store() -> None:
    old = filled()
    history = old.history(C)
    assert history is not None
    new = ConversationStore()
    assert new.import_history(C, history)
    moved = new.history(C)
    assert moved is not None
    assert (moved.turns, moved.keys) == (((4, 5), (6,)), (("c",), ("a", "d")))
    assert (moved.turn_count, moved.dropped_since, moved.in_flight) == (3, 1, False)
    assert new.turn_count(C) == 3
    # Dedup: the live turns' chunks are sent; "b" went with the dropped turn.
    chunks = [make_chunk(f"text {k}", id=k) for k in "abcde"]
    fresh, seen = new.split(C, chunks)
    assert [c.key for c in seen] == ["a", "c", "d"] and [c.key for c in fresh] == ["b", "e"]
    assert new.record_turn(C, [ChunkKey("e")], [7]) == 4
    new._check_invariants()
    # The old store is untouched (the caller drops it there).
    assert old.history(C) == history


def test_refusals_change_nothing() -> None:
    history = filled().history(C)
    assert history is not None
    live = ConversationStore()
    live.record_turn(C, [ChunkKey("x")], [9])
    assert not live.import_history(C, history)
    assert live.turn_count(C) == 1
    held = ConversationStore()
    assert held.hold(C)
    assert not held.import_history(C, history)
    assert held.turn_count(C) == 0
    idle = ConversationStore()
    assert idle.hold(C)
    idle.release(C)  # known with no turns: replaced
    assert idle.import_history(C, history) and idle.turn_count(C) == 3


def test_bad_histories_are_refused() -> None:
    history = filled().history(C)
    assert history is not None
    store = ConversationStore()
    bad: list[ConversationHistory] = [
        replace(history, turns=((4, 5), None)),
        replace(history, turns=((4, -1), (6,))),
        replace(history, keys=((ChunkKey("c"), ChunkKey("c")), history.keys[1])),
        replace(history, keys=history.keys[:1]),
        replace(history, turn_count=1),
        replace(history, dropped_since=-1),
    ]
    for h in bad:
        with pytest.raises(ValueError, match="history"):
            store.import_history(C, h)
    with pytest.raises(ValueError, match="ConversationHistory"):
        store.import_history(C, "not a history")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="conversation_id"):
        store.import_history(None, history)  # type: ignore[arg-type]
    assert len(store) == 0
    store.replicated = True
    with pytest.raises(RuntimeError, match="replicated"):
        store.import_history(C, history)


def test_router_predicts_no_cache_for_a_carried_history_on_its_new_home() -> None:
    router = Router(["r0", "r1"], "craft_joint", RouterConfig())

    def turn(names: str) -> tuple[int, bool, int, int]:
        chunks = [make_chunk(f"text of {n}", id=n, num_tokens=64) for n in names.split()]
        d = router.route(chunks, prompt_tokens=400, conversation_id="c")
        router.planner(d.replica, None).commit(d.plan, prefix_tokens=32)
        assert router.finish(d)
        return int(d.replica[1]), d.rehomed, d.plan.turn, d.predicted_cached_tokens

    assert turn("a b")[:3] == (0, False, 1)
    assert turn("c")[:3] == (0, False, 2)
    old = router.planner("r0", None)
    report = router.mark_down("r0")
    assert report.rehomed == (("c", "r1"),)
    history = old.conversations.history(C)
    assert history is not None  # a bare planner records no token ids: give it some
    history = replace(history, turns=tuple((1, 2) for _ in history.keys))
    assert router.planner("r1", None).conversations.import_history(C, history)
    # Turn 3 continues on r1, but none of its history is cached there yet.
    assert turn("d") == (1, True, 3, 0)
    replica, rehomed, number, cached = turn("e")
    assert (replica, rehomed, number) == (1, False, 4) and cached > 0
