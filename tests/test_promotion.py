"""Promotion rules (paper §4.2 "Table Update and Maintenance")."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from craft_rag.access_table import ChunkAccessTable
from craft_rag.promotion import (
    PROMOTION_RULES,
    PromotionInput,
    ServedPromotion,
    ThresholdPromotion,
    get_promotion_rule,
)
from craft_rag.types import ChunkKey


def ks(*names: str) -> list[ChunkKey]:
    return [ChunkKey(n) for n in names]


def table_with(counts: dict[str, int]) -> ChunkAccessTable:
    table = ChunkAccessTable(window=None)
    for name, count in counts.items():
        for _ in range(count):
            table.record(ks(name))
    return table


def promote(rule: str, ordered: list[str], matched: int, counts: dict[str, int], t: int = 2) -> int:
    request = PromotionInput(ks(*ordered), matched, table_with(counts), t)
    return get_promotion_rule(rule).promote(request)


def test_registry() -> None:
    assert set(PROMOTION_RULES) == {"threshold", "served"}
    assert isinstance(get_promotion_rule("threshold"), ThresholdPromotion)
    assert isinstance(get_promotion_rule("served"), ServedPromotion)
    assert get_promotion_rule("served").name == "served"


def test_unknown_rule_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match="served") as info:
        get_promotion_rule("always")
    assert "threshold" in str(info.value)


def test_threshold_paper_example_first_request_promotes_hot_leading_run() -> None:
    # After [C1, C2, C5]: C1:2, C2:2, C5:1 with T=2 -> insert [C1, C2].
    assert promote("threshold", ["C1", "C2", "C5"], 0, {"C1": 2, "C2": 2, "C5": 1}) == 2


def test_threshold_paper_example_reuse_without_extension() -> None:
    # [C1, C2] reused, C6 at 1 < T: nothing to insert.
    assert promote("threshold", ["C1", "C2", "C6"], 2, {"C1": 3, "C2": 3, "C6": 1}) == 0


def test_threshold_paper_example_reuse_with_extension() -> None:
    # [C1, C2] reused again, C6 reached T: extend by one chunk.
    assert promote("threshold", ["C1", "C2", "C6"], 2, {"C1": 4, "C2": 4, "C6": 2}) == 3


def test_threshold_extends_by_one_chunk_only() -> None:
    assert promote("threshold", ["A", "B", "C"], 1, {"A": 5, "B": 5, "C": 5}) == 2


def test_threshold_run_stops_at_first_cold_chunk() -> None:
    assert promote("threshold", ["A", "B", "C"], 0, {"A": 2, "B": 1, "C": 9}) == 1
    assert promote("threshold", ["A", "B"], 0, {"A": 1, "B": 9}) == 0
    assert promote("threshold", ["A", "B"], 0, {"A": 3, "B": 3}, t=3) == 2
    assert promote("threshold", ["A", "B"], 0, {"A": 3, "B": 3}, t=4) == 0


def test_threshold_full_match_has_nothing_to_extend() -> None:
    assert promote("threshold", ["A", "B"], 2, {"A": 9, "B": 9}) == 0


def test_rules_on_an_empty_request() -> None:
    assert promote("threshold", [], 0, {}) == 0
    assert promote("served", [], 0, {}) == 0


def test_served_inserts_the_whole_served_order() -> None:
    assert promote("served", ["A", "B", "C"], 0, {}) == 3
    assert promote("served", ["A", "B", "C"], 2, {"A": 1}) == 3


@settings(max_examples=100, deadline=None)
@given(
    ordered=st.lists(st.sampled_from("ABCDEF"), max_size=6, unique=True),
    counts=st.dictionaries(st.sampled_from("ABCDEF"), st.integers(1, 4)),
    t=st.integers(1, 4),
    data=st.data(),
)
def test_threshold_rule_matches_the_paper_text(
    ordered: list[str], counts: dict[str, int], t: int, data: st.DataObject
) -> None:
    matched = data.draw(st.integers(0, len(ordered)))
    depth = promote("threshold", ordered, matched, counts, t)
    hot = [counts.get(k, 0) >= t for k in ordered]
    if matched == 0:
        # "if the chunks in a prefix all reach the threshold, we promote this"
        assert all(hot[:depth])
        assert depth == len(ordered) or not hot[depth]
    elif matched < len(ordered) and hot[matched]:
        assert depth == matched + 1  # "extend the existing chunk-prefix by the new chunk"
    else:
        assert depth == 0
