"""Overlap metrics of the paper (§3.1) and the reuse fractions' helpers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from craft_rag.metrics import fraction, lcp, prefix_overlap, total_overlap

R1 = ["C1", "C4", "C5", "C6", "C7"]
R2 = ["C1", "C2", "C3", "C4", "C5"]
R2_REORDERED = ["C1", "C4", "C5", "C2", "C3"]


def test_paper_example_lcp_is_1_but_3_chunks_are_shared() -> None:
    assert lcp(R1, R2) == 1
    assert len(set(R1) & set(R2)) == 3
    assert prefix_overlap([R1, R2]) == pytest.approx(1 / 5)
    assert total_overlap([R1, R2]) == pytest.approx(3 / 5)


def test_paper_example_reordering_triples_the_prefix() -> None:
    assert lcp(R1, R2_REORDERED) == 3
    assert prefix_overlap([R1, R2_REORDERED]) == pytest.approx(3 / 5)
    assert total_overlap([R1, R2_REORDERED]) == pytest.approx(3 / 5)  # position-free


def test_best_earlier_request_is_used_and_only_earlier_ones() -> None:
    requests = [["a", "b", "c", "d"], ["a", "x", "y", "z"], ["a", "b", "c", "q"], ["z", "y"]]
    # R2: best LCP 1 (R1); R3: best LCP 3 (R1); R4: 0 (R2 starts with a)
    assert prefix_overlap(requests) == pytest.approx((1 / 4 + 3 / 4 + 0) / 3)
    # R2: shares {a} with R1; R3: {a,b,c} with R1; R4: {z,y} with R2
    assert total_overlap(requests) == pytest.approx((1 / 4 + 3 / 4 + 2 / 2) / 3)
    # a later request never counts for an earlier one
    assert prefix_overlap([["a"], ["b"], ["a"]]) == pytest.approx((0 + 1) / 2)


def test_fewer_than_two_requests() -> None:
    assert prefix_overlap([]) == 0.0 == total_overlap([])
    assert prefix_overlap([["a"]]) == 0.0 == total_overlap([["a"]])


def test_empty_requests_contribute_zero_but_count() -> None:
    assert prefix_overlap([["a"], [], ["a"]]) == pytest.approx((0 + 1) / 2)
    assert total_overlap([["a"], [], ["a"]]) == pytest.approx((0 + 1) / 2)


def test_identical_requests_are_fully_overlapping() -> None:
    requests = [["a", "b", "c"]] * 4
    assert prefix_overlap(requests) == 1.0
    assert total_overlap(requests) == 1.0


def test_k_is_per_request() -> None:
    assert prefix_overlap([["a", "b"], ["a", "b", "c", "d"]]) == pytest.approx(2 / 4)
    assert total_overlap([["a", "b", "c", "d"], ["b", "a"]]) == pytest.approx(2 / 2)


def test_unicode_and_any_hashable_keys() -> None:
    assert prefix_overlap([["文", 1, (2, 3)], ["文", 1, "x"]]) == pytest.approx(2 / 3)
    assert total_overlap([["🗼", "é"], ["é"]]) == 1.0


def test_lcp_and_fraction() -> None:
    assert lcp([], ["a"]) == 0
    assert lcp(["a", "b"], ["a", "b", "c"]) == 2
    assert lcp(["b"], ["a"]) == 0
    assert fraction(1, 4) == 0.25
    assert fraction(3, 0) == 0.0


def naive_prefix(requests: list[list[str]]) -> float:
    if len(requests) < 2:
        return 0.0
    total = 0.0
    for i in range(1, len(requests)):
        if requests[i]:
            best = max(lcp(requests[i], requests[j]) for j in range(i))
            total += best / len(requests[i])
    return total / (len(requests) - 1)


def naive_total(requests: list[list[str]]) -> float:
    if len(requests) < 2:
        return 0.0
    total = 0.0
    for i in range(1, len(requests)):
        if requests[i]:
            best = max(len(set(requests[i]) & set(requests[j])) for j in range(i))
            total += best / len(requests[i])
    return total / (len(requests) - 1)


request_lists = st.lists(st.lists(st.sampled_from("abcdef"), max_size=6), max_size=12)
distinct_request_lists = st.lists(
    st.lists(st.sampled_from("abcdef"), max_size=6, unique=True), max_size=12
)


@settings(max_examples=150, deadline=None)
@given(request_lists)
def test_prefix_overlap_equals_the_formula(requests: list[list[str]]) -> None:
    assert prefix_overlap(requests) == pytest.approx(naive_prefix(requests))


@settings(max_examples=150, deadline=None)
@given(distinct_request_lists)
def test_total_overlap_equals_the_formula(requests: list[list[str]]) -> None:
    assert total_overlap(requests) == pytest.approx(naive_total(requests))


@settings(max_examples=100, deadline=None)
@given(distinct_request_lists)
def test_prefix_never_exceeds_total(requests: list[list[str]]) -> None:
    assert 0.0 <= prefix_overlap(requests) <= total_overlap(requests) + 1e-12 <= 1.0 + 1e-12
