"""Conversation-scoped chunk dedup (paper §4.3): ChunkMap, LRU/TTL bounds, end()."""

from __future__ import annotations

import json

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.conversation import ConversationRegistry
from craft_rag.testing import FakeClock
from craft_rag.types import ChunkKey, ConversationId


def make_chunks(*names: str) -> list[Chunk]:
    return [make_chunk(f"text {n}", id=n) for n in names]


def names(chunks: list[Chunk]) -> list[str]:
    return [c.key for c in chunks]


def cid(name: str) -> ConversationId:
    return ConversationId(name)


def record(reg: ConversationRegistry, conv: str, *keys: str) -> int:
    return reg.record_turn(cid(conv), [ChunkKey(k) for k in keys])


def test_paper_two_turn_example() -> None:
    # Turn 1 retrieves [C1, C2, C3]; turn 2 retrieves [C2, C3, C4]: only C4 is new.
    reg = ConversationRegistry(clock=FakeClock())
    new, seen = reg.split(cid("conv"), make_chunks("C1", "C2", "C3"))
    assert names(new) == ["C1", "C2", "C3"] and seen == []
    assert record(reg, "conv", "C1", "C2", "C3") == 1
    new, seen = reg.split(cid("conv"), make_chunks("C2", "C3", "C4"))
    assert names(new) == ["C4"]
    assert names(seen) == ["C2", "C3"]
    reg._check_invariants()


def test_paper_request_dedup_example() -> None:
    # Turn 1 [C1..C5]; turn 2 retrieves [C1, C3, C6, C7, C8] -> [C6, C7, C8], C1/C3 removed.
    reg = ConversationRegistry(clock=FakeClock())
    record(reg, "conv", "C1", "C2", "C3", "C4", "C5")
    new, seen = reg.split(cid("conv"), make_chunks("C1", "C3", "C6", "C7", "C8"))
    assert names(new) == ["C6", "C7", "C8"]
    assert names(seen) == ["C1", "C3"]


def test_split_keeps_input_order_and_is_read_only() -> None:
    reg = ConversationRegistry(clock=FakeClock())
    record(reg, "c", "B", "D")
    before = json.dumps(reg.to_json())
    new, seen = reg.split(cid("c"), make_chunks("D", "E", "B", "A"))
    assert names(new) == ["E", "A"] and names(seen) == ["D", "B"]
    assert json.dumps(reg.to_json()) == before
    new, seen = reg.split(cid("other"), make_chunks("B"))
    assert names(new) == ["B"] and seen == []
    assert "other" not in reg


def test_conversations_are_independent() -> None:
    reg = ConversationRegistry(clock=FakeClock())
    record(reg, "a", "X")
    new, _ = reg.split(cid("b"), make_chunks("X"))
    assert names(new) == ["X"]


def test_turns_are_frozen_in_served_order() -> None:
    reg = ConversationRegistry(clock=FakeClock())
    assert record(reg, "c", "B", "A") == 1
    assert record(reg, "c", "C") == 2
    assert record(reg, "c") == 3  # a turn whose chunks were all duplicates
    assert reg.turns(cid("c")) == [("B", "A"), ("C",), ()]
    assert reg.turn_count(cid("c")) == 3
    assert reg.turn_count(cid("unknown")) == 0
    assert reg.turns(cid("unknown")) == []


def test_end_forgets_a_conversation() -> None:
    reg = ConversationRegistry(clock=FakeClock())
    record(reg, "c", "A")
    assert reg.end(cid("c")) is True
    assert reg.end(cid("c")) is False
    assert "c" not in reg and len(reg) == 0
    new, seen = reg.split(cid("c"), make_chunks("A"))
    assert names(new) == ["A"] and seen == []
    assert record(reg, "c", "A") == 1  # a new conversation under the old id


def test_lru_bound_evicts_least_recently_used_first() -> None:
    clock = FakeClock()
    reg = ConversationRegistry(max_conversations=2, ttl_s=None, clock=clock)
    record(reg, "a", "X")
    clock.tick()
    record(reg, "b", "X")
    clock.tick()
    record(reg, "a", "Y")  # a is now the most recent
    clock.tick()
    record(reg, "c", "X")  # evicts b
    assert [c["id"] for c in reg.to_json()["conversations"]] == ["a", "c"]  # LRU first
    clock.tick()
    record(reg, "d", "X")  # evicts a
    assert [c["id"] for c in reg.to_json()["conversations"]] == ["c", "d"]
    reg._check_invariants()


def test_split_does_not_refresh_lru_position() -> None:
    clock = FakeClock()
    reg = ConversationRegistry(max_conversations=2, ttl_s=None, clock=clock)
    record(reg, "a", "X")
    clock.tick()
    record(reg, "b", "X")
    clock.tick()
    reg.split(cid("a"), make_chunks("X"))  # reading is not a use
    record(reg, "c", "X")
    assert "a" not in reg and "b" in reg


def test_ttl_expiry_at_the_boundary() -> None:
    clock = FakeClock(100.0)
    reg = ConversationRegistry(ttl_s=10.0, clock=clock)
    record(reg, "c", "A", "B")
    clock.tick(10.0)  # idle exactly ttl: still live
    assert reg.turn_count(cid("c")) == 1
    assert names(reg.split(cid("c"), make_chunks("A"))[1]) == ["A"]
    clock.tick(0.5)  # idle longer than ttl: treated as new
    assert reg.turn_count(cid("c")) == 0
    assert reg.turns(cid("c")) == []
    new, seen = reg.split(cid("c"), make_chunks("A", "C"))
    assert names(new) == ["A", "C"] and seen == []
    assert "c" in reg  # purged lazily, on the next write
    assert record(reg, "c", "C") == 1  # restarts at turn 1, old chunks forgotten
    assert reg.turns(cid("c")) == [("C",)]


def test_a_write_purges_expired_conversations() -> None:
    clock = FakeClock()
    reg = ConversationRegistry(ttl_s=5.0, clock=clock)
    record(reg, "old1", "A")
    clock.tick(1)
    record(reg, "old2", "A")
    clock.tick(1)
    record(reg, "fresh", "A")
    clock.tick(5.5)  # old1 idle 7.5, old2 6.5, fresh 5.5: all past ttl
    record(reg, "new", "A")
    assert len(reg) == 1 and "new" in reg
    reg._check_invariants()


def test_use_keeps_a_conversation_alive() -> None:
    clock = FakeClock()
    reg = ConversationRegistry(ttl_s=5.0, clock=clock)
    for turn in range(1, 6):
        clock.tick(4.0)
        assert record(reg, "c", f"K{turn}") == turn


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_conversations": 0}, "max_conversations"),
        ({"max_conversations": 1.5}, "max_conversations"),
        ({"ttl_s": 0}, "ttl_s"),
        ({"ttl_s": -1.0}, "ttl_s"),
    ],
)
def test_bad_arguments(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ConversationRegistry(**kwargs)


def test_json_round_trip() -> None:
    clock = FakeClock(7.0)
    reg = ConversationRegistry(max_conversations=5, ttl_s=30.0, clock=clock)
    record(reg, "会話", "文書:1", "B")
    clock.tick()
    record(reg, "b", "C")
    record(reg, "会話", "D")
    data = json.loads(json.dumps(reg.to_json()))
    loaded = ConversationRegistry.from_json(data, clock=clock)
    loaded._check_invariants()
    assert loaded.to_json() == reg.to_json()
    assert loaded.turns(cid("会話")) == [("文書:1", "B"), ("D",)]
    assert names(loaded.split(cid("会話"), make_chunks("B", "E"))[0]) == ["E"]
    with pytest.raises(ValueError, match="conversation"):
        ConversationRegistry.from_json({"format": "nope"})


def test_unicode_and_many_chunks() -> None:
    reg = ConversationRegistry(clock=FakeClock())
    big = make_chunks(*(f"ч{i}" for i in range(10_000)))
    reg.record_turn(cid("🗨"), [c.key for c in big[:5000]])
    new, seen = reg.split(cid("🗨"), big)
    assert len(new) == 5000 and len(seen) == 5000
    assert new[0].key == "ч5000"


# ---- state machine: the registry against an exact model ------------------------------------------

CONVS = ["a", "b", "c", "d"]
KEYS = ["K1", "K2", "K3", "K4", "K5"]


class ConversationMachine(RuleBasedStateMachine):
    @initialize(
        max_conversations=st.integers(1, 3),
        ttl=st.sampled_from([None, 2.0, 5.0]),
    )
    def setup(self, max_conversations: int, ttl: float | None) -> None:
        self.clock = FakeClock()
        self.reg = ConversationRegistry(max_conversations, ttl, clock=self.clock)
        self.max, self.ttl = max_conversations, ttl
        # exact model: LRU-ordered conv -> (turns, last_used)
        self.model: dict[str, tuple[list[tuple[str, ...]], float]] = {}
        # everything ever recorded per conversation since its last end()
        self.ever: dict[str, set[str]] = {c: set() for c in CONVS}

    def ready(self) -> bool:
        return hasattr(self, "reg")

    def live(self, conv: str) -> list[tuple[str, ...]] | None:
        if conv not in self.model:
            return None
        turns, last = self.model[conv]
        if self.ttl is not None and self.clock.now - last > self.ttl:
            return None
        return turns

    @precondition(ready)
    @rule(conv=st.sampled_from(CONVS), keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def split_then_record(self, conv: str, keys: list[str]) -> None:
        chunks = make_chunks(*dict.fromkeys(keys))
        new, seen = self.reg.split(cid(conv), chunks)
        turns = self.live(conv)
        sent = {k for t in turns for k in t} if turns is not None else set()
        assert names(seen) == [c.key for c in chunks if c.key in sent]
        assert names(new) == [c.key for c in chunks if c.key not in sent]
        # dedup never removes a chunk not sent earlier in this conversation
        assert set(names(seen)) <= self.ever[conv]
        index = self.reg.record_turn(cid(conv), [c.key for c in new])
        # model the write
        turns = list(turns) if turns is not None else []
        turns.append(tuple(names(new)))
        self.model.pop(conv, None)
        self.model[conv] = (turns, self.clock.now)
        if self.ttl is not None:
            ttl = self.ttl
            self.model = {
                c: v for c, v in self.model.items() if self.clock.now - v[1] <= ttl
            }
        while len(self.model) > self.max:
            del self.model[next(iter(self.model))]
        assert index == len(turns)
        self.ever[conv] |= set(names(new))

    @precondition(ready)
    @rule(conv=st.sampled_from(CONVS))
    def end(self, conv: str) -> None:
        assert self.reg.end(cid(conv)) == (conv in self.model)
        self.model.pop(conv, None)
        self.ever[conv] = set()

    @precondition(ready)
    @rule(by=st.sampled_from([0.5, 1.0, 3.0]))
    def tick(self, by: float) -> None:
        self.clock.tick(by)

    @precondition(ready)
    @rule()
    def round_trip(self) -> None:
        data = json.loads(json.dumps(self.reg.to_json()))
        self.reg = ConversationRegistry.from_json(data, clock=self.clock)

    @precondition(ready)
    @invariant()
    def registry_equals_model(self) -> None:
        self.reg._check_invariants()
        assert [c["id"] for c in self.reg.to_json()["conversations"]] == list(self.model)
        for conv in CONVS:
            turns = self.live(conv)
            assert self.reg.turns(cid(conv)) == (turns or [])
            assert self.reg.turn_count(cid(conv)) == len(turns or [])


ConversationMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None
)
TestConversationMachine = ConversationMachine.TestCase
