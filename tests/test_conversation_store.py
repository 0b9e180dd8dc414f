"""The one conversation store (issue 12 item 1): keys and token turns under one LRU + TTL bound
with an injected clock, the turn in flight, save/load with tokens; its invariant
(``sent`` == the union of the live turns' keys) under random operations."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from craft_rag.conversation import (
    ConversationRegistry,
    ConversationStore,
    ConversationStoreProtocol,
)
from craft_rag.testing import FakeClock
from craft_rag.types import ChunkKey, ConversationId


def cid(name: str) -> ConversationId:
    return ConversationId(name)


def keys(*names: str) -> list[ChunkKey]:
    return [ChunkKey(n) for n in names]


def test_the_former_name_is_the_store_and_it_meets_the_protocol() -> None:
    assert ConversationRegistry is ConversationStore
    store: ConversationStoreProtocol = ConversationStore()
    assert store.turn_count(cid("c")) == 0


def test_keys_and_tokens_are_one_record_under_one_lru_bound() -> None:
    clock = FakeClock()
    store = ConversationStore(max_conversations=2, ttl_s=None, clock=clock)
    for i, name in enumerate(("a", "b", "c")):
        clock.now += 1
        store.record_turn(cid(name), keys(f"k{i}"), (i, i + 1))
        store._check_invariants()
    # "a" is evicted as a whole: its keys (dedup) and its tokens (prompt) together.
    assert store.history(cid("a")) is None and store.split(cid("a"), []) == ([], [])
    history = store.history(cid("c"))
    assert history is not None
    assert history.turns == ((2, 3),) and history.keys == (("k2",),) and history.tokens == 2


def test_ttl_expires_keys_and_tokens_together_but_not_a_turn_in_flight() -> None:
    clock = FakeClock()
    store = ConversationStore(max_conversations=5, ttl_s=10.0, clock=clock)
    store.record_turn(cid("idle"), keys("x"), (1,))
    store.record_turn(cid("busy"), keys("y"), (2,))
    clock.now = 5.0
    assert store.hold(cid("busy")) and not store.hold(cid("busy"))
    clock.now = 10.0
    assert store.turn_count(cid("idle")) == 1  # at the boundary: still live
    clock.now = 10.5
    assert store.history(cid("idle")) is None  # expired: keys and tokens
    busy = store.history(cid("busy"))
    assert busy is not None and busy.in_flight and busy.turns == ((2,),)
    store.record_turn(cid("other"), keys("z"), (3,))  # a write purges the expired one
    assert "idle" not in store and "busy" in store
    store._check_invariants()
    store.record_turn(cid("busy"), keys("w"), (4,))  # recording ends the turn in flight
    busy = store.history(cid("busy"))
    assert busy is not None and not busy.in_flight and busy.turn_count == 2
    clock.now = 25.0  # a hold older than the TTL no longer protects
    assert store.hold(cid("other")) and store.turn_count(cid("other")) == 0


def test_a_turn_in_flight_is_never_evicted_by_the_lru_bound() -> None:
    clock = FakeClock()
    store = ConversationStore(max_conversations=1, ttl_s=None, clock=clock)
    store.record_turn(cid("a"), keys("k"), (1,))
    assert store.hold(cid("a"))
    for name in ("b", "c"):
        clock.now += 1
        store.record_turn(cid(name), keys(name), (2,))
        store._check_invariants()
    assert store.turn_count(cid("a")) == 1 and store.turn_count(cid("b")) == 0
    assert len(store) == 2  # over the bound by the one turn in flight
    store.release(cid("a"))  # not served: idle again, and the bound applies
    store._check_invariants()
    assert len(store) == 1 and store.turn_count(cid("c")) == 1


def test_dropped_turns_free_their_tokens_and_are_reported_once() -> None:
    store = ConversationStore(ttl_s=None)
    for i in range(3):
        store.record_turn(cid("c"), keys(f"k{i}", "shared") if i == 2 else keys(f"k{i}"), (i,))
    assert store.forget_oldest_turns(cid("c"), 2) == 2
    history = store.history(cid("c"))
    assert history is not None
    assert history.turns == ((2,),) and history.dropped_since == 2 and history.turn_count == 3
    assert store.split(cid("c"), [])[1] == []
    store._check_invariants()
    store.record_turn(cid("c"), keys("k3"), (3,))
    history = store.history(cid("c"))
    assert history is not None and history.dropped_since == 0


def test_save_load_round_trip_keeps_tokens_drops_and_the_bound() -> None:
    clock = FakeClock()
    store = ConversationStore(max_conversations=3, ttl_s=60.0, clock=clock)
    store.record_turn(cid("a"), keys("x", "y"), (5, 6, 7))
    store.record_turn(cid("a"), keys("z"), (8,))
    store.forget_oldest_turns(cid("a"), 1)
    store.record_turn(cid("b"), keys("x"))  # a turn whose tokens are not known here
    assert store.hold(cid("new"))  # in flight, no turn yet: not saved
    data = json.loads(json.dumps(store.to_json()))
    loaded = ConversationStore.from_json(data, clock=clock)
    loaded._check_invariants()
    assert loaded.to_json() == data
    assert [c["id"] for c in data["conversations"]] == ["a", "b"]
    for name in ("a", "b"):
        assert loaded.history(cid(name)) == _idle(store, name)
    a = loaded.history(cid("a"))
    assert a is not None and a.turns == ((8,),) and a.dropped_since == 1
    assert loaded.max_conversations == 3 and loaded.ttl_s == 60.0


def _idle(store: ConversationStore, name: str) -> object:
    history = store.history(cid(name))
    assert history is not None and not history.in_flight
    return history


@pytest.mark.parametrize(
    ("tokens", "error"),
    [
        ([[1], [2]], "one per turn"),
        ([["x"]], "ints >= 0"),
        ([[-1]], "ints >= 0"),
        ("nope", "tokens"),
    ],
)
def test_bad_saved_tokens_are_refused_naming_the_field(tokens: object, error: str) -> None:
    store = ConversationStore(ttl_s=None)
    store.record_turn(cid("a"), keys("x"), (1,))
    data = store.to_json()
    data["conversations"][0]["tokens"] = tokens
    with pytest.raises(ValueError, match=error) as info:
        ConversationStore.from_json(data)
    assert "conversations[0].tokens" in str(info.value)


def test_a_dropped_turn_saved_with_tokens_is_refused() -> None:
    store = ConversationStore(ttl_s=None)
    store.record_turn(cid("a"), keys("x"), (1,))
    store.record_turn(cid("a"), keys("y"), (2,))
    store.forget_oldest_turns(cid("a"), 1)
    data = store.to_json()
    data["conversations"][0]["tokens"] = [[1], [2]]
    with pytest.raises(ValueError, match="dropped turn keeps no token ids"):
        ConversationStore.from_json(data)


def test_bad_tokens_change_nothing() -> None:
    store = ConversationStore(ttl_s=None)
    with pytest.raises(ValueError, match="tokens"):
        store.record_turn(cid("a"), keys("x"), (1, -2))
    assert "a" not in store


def test_seeded_operations_keep_the_invariant_under_the_injected_clock() -> None:
    """Random record / hold / release / forget / end / tick: ``sent`` stays the union of the
    live turns' keys, tokens stay parallel to turns, the bound holds but for turns in flight,
    LRU order follows the clock."""
    rng = random.Random(12)
    clock = FakeClock()
    store = ConversationStore(max_conversations=4, ttl_s=30.0, clock=clock)
    pool = [f"k{i}" for i in range(12)]
    for _ in range(3000):
        name = cid(f"c{rng.randrange(8)}")
        action = rng.random()
        if action < 0.45:
            picked = rng.sample(pool, rng.randrange(0, 4))
            tokens = None if rng.random() < 0.1 else tuple(rng.randrange(100) for _ in picked)
            store.record_turn(name, keys(*picked), tokens)
        elif action < 0.6:
            store.hold(name)
        elif action < 0.7:
            store.release(name)
        elif action < 0.8:
            store.forget_oldest_turns(name, rng.randrange(3))
        elif action < 0.85:
            store.end(name)
        else:
            clock.now += rng.choice([0.5, 3.0, 31.0])
        store._check_invariants()
        history = store.history(name)
        if history is not None:
            live = {k for turn in history.keys for k in turn}
            new, seen = store.split(name, [])
            assert new == [] and seen == []
            assert len(history.turns) == len(history.keys)
            assert store.turn_count(name) == history.turn_count
            assert all(k in pool for k in live)


def test_a_planner_commit_records_keys_and_tokens_and_save_load_keeps_them(
    tmp_path: Path,
) -> None:
    from craft_rag.chunk import make_chunk
    from craft_rag.planner import CraftPlanner

    planner = CraftPlanner()
    chunks = [make_chunk(f"text {n}", id=n) for n in ("a", "b")]
    plan = planner.plan(chunks, "chat")
    with pytest.raises(ValueError, match="turn_tokens"):
        planner.commit(plan, turn_tokens=[1, -1])  # refused before anything changed
    planner.commit(plan, turn_tokens=[7, 8, 9])
    history = planner.conversations.history(cid("chat"))
    assert history is not None
    assert history.keys == (plan.keys,) and history.turns == ((7, 8, 9),)
    path = tmp_path / "planner.json"
    planner.save(path)
    loaded = CraftPlanner.load(path)
    assert loaded.conversations.history(cid("chat")) == history
    loaded._check_invariants()
