"""Chunk-Access Table (paper §4.1): sliding-window access counts."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from craft_rag.access_table import DEFAULT_WINDOW, ChunkAccessTable
from craft_rag.types import ChunkKey


def keys(*names: str) -> list[ChunkKey]:
    return [ChunkKey(n) for n in names]


def test_counts_follow_requests() -> None:
    table = ChunkAccessTable(window=10)
    table.record(keys("C1", "C2"))
    table.record(keys("C1", "C2", "C5"))
    assert table.count(ChunkKey("C1")) == 2
    assert table.count(ChunkKey("C2")) == 2
    assert table.count(ChunkKey("C5")) == 1
    assert table.count(ChunkKey("C9")) == 0
    assert table.counts(keys("C5", "C9", "C1")) == [1, 0, 2]
    assert len(table) == 3
    assert "C5" in table and "C9" not in table
    assert table.requests_in_window == 2
    table._check_invariants()


def test_default_window_is_1000() -> None:
    assert ChunkAccessTable().window == DEFAULT_WINDOW == 1000


def test_window_expires_oldest_request_and_drops_zero_counts() -> None:
    table = ChunkAccessTable(window=2)
    table.record(keys("A", "B"))
    table.record(keys("B", "C"))
    table.record(keys("C", "D"))  # pushes out [A, B]
    assert table.requests_in_window == 2
    assert "A" not in table  # count reached 0: it left the table
    assert table.counts(keys("A", "B", "C", "D")) == [0, 1, 2, 1]
    assert len(table) == 3
    table.record(keys("E"))  # pushes out [B, C]
    assert table.counts(keys("B", "C", "D", "E")) == [0, 1, 1, 1]
    assert len(table) == 3
    table._check_invariants()


def test_a_request_counts_each_chunk_once() -> None:
    table = ChunkAccessTable(window=5)
    table.record(keys("A", "A", "B", "A"))
    assert table.counts(keys("A", "B")) == [1, 1]
    table._check_invariants()


def test_empty_request_takes_a_window_slot() -> None:
    table = ChunkAccessTable(window=1)
    table.record(keys("A"))
    table.record([])
    assert len(table) == 0
    assert table.requests_in_window == 1
    table._check_invariants()


def test_unlimited_window() -> None:
    table = ChunkAccessTable(window=None)
    for _ in range(2500):
        table.record(keys("A"))
    assert table.count(ChunkKey("A")) == 2500
    table._check_invariants()


@pytest.mark.parametrize("bad", [0, -3, 1.5, "10"])
def test_bad_window_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="window"):
        ChunkAccessTable(window=bad)


def test_json_round_trip_is_plain_json_and_exact() -> None:
    table = ChunkAccessTable(window=3)
    for request in (["A", "B"], ["ü", "B"], ["C"], ["A", "文"]):
        table.record(keys(*request))
    text = table.dumps()
    assert json.loads(text)["format"] == "craft-rag/access-table/v1"
    loaded = ChunkAccessTable.loads(text)
    assert loaded.window == 3
    assert loaded.to_json() == table.to_json()
    for key in ("A", "B", "C", "ü", "文"):
        assert loaded.count(ChunkKey(key)) == table.count(ChunkKey(key))
    loaded._check_invariants()
    # the loaded window keeps sliding exactly like the original
    table.record(keys("B"))
    loaded.record(keys("B"))
    assert loaded.to_json() == table.to_json()


@pytest.mark.parametrize("data", [{}, {"format": "other"}, [], "x"])
def test_foreign_json_is_rejected(data: object) -> None:
    with pytest.raises(ValueError, match="access table"):
        ChunkAccessTable.from_json(data)


def test_many_distinct_chunks_in_one_request() -> None:
    table = ChunkAccessTable(window=2)
    big = [ChunkKey(f"c{i}") for i in range(10_000)]
    table.record(big)
    table.record(big[:10])
    table.record([])
    assert len(table) == 10
    table._check_invariants()


KEY_NAMES = st.sampled_from(["A", "B", "C", "D", "E", "F"])


class AccessTableMachine(RuleBasedStateMachine):
    """Counts always equal a naive recount of the last ``window`` requests."""

    @initialize(window=st.integers(min_value=1, max_value=4))
    def setup(self, window: int) -> None:
        self.table = ChunkAccessTable(window=window)
        self.history: list[list[ChunkKey]] = []

    @rule(request=st.lists(KEY_NAMES, max_size=6))
    def record(self, request: list[str]) -> None:
        ks = keys(*request)
        self.table.record(ks)
        self.history.append(ks)

    @precondition(lambda self: hasattr(self, "table"))
    @rule()
    def round_trip(self) -> None:
        self.table = ChunkAccessTable.loads(self.table.dumps())

    @precondition(lambda self: hasattr(self, "table"))
    @invariant()
    def counts_equal_naive_recount(self) -> None:
        self.table._check_invariants()
        window = self.table.window
        assert window is not None
        recount: Counter[str] = Counter()
        for request in self.history[-window:]:
            recount.update(set(request))
        for name in ["A", "B", "C", "D", "E", "F"]:
            assert self.table.count(ChunkKey(name)) == recount[name]
        assert len(self.table) == len(recount)
        assert self.table.requests_in_window == min(window, len(self.history))


AccessTableMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None
)
TestAccessTableMachine = AccessTableMachine.TestCase
