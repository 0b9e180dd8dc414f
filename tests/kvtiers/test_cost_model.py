"""Prefill cost model: interpolation, extrapolation, prefix-aware block cost."""

from __future__ import annotations

import pytest

from craft_rag.kvtiers.cost_model import DEFAULT_CPU_PROFILE, PrefillCostModel, default_cost_model


def make_model() -> PrefillCostModel:
    return PrefillCostModel([(100, 1.0), (0, 0.0), (200, 3.0)])


def test_interpolates_between_and_on_points() -> None:
    model = make_model()
    assert model.points == [(0, 0.0), (100, 1.0), (200, 3.0)]
    assert model.prefill_time(100) == pytest.approx(1.0)
    assert model.prefill_time(50) == pytest.approx(0.5)
    assert model.prefill_time(150) == pytest.approx(2.0)


def test_extrapolates_with_the_end_segments_and_clamps_at_zero() -> None:
    model = PrefillCostModel([(100, 1.0), (200, 3.0)])
    assert model.prefill_time(300) == pytest.approx(5.0)
    assert model.prefill_time(25) == 0.0  # -0.5 clamped
    assert model.prefill_time(0) == 0.0


def test_block_cost_is_prefix_aware() -> None:
    model = make_model()
    early = model.block_cost(0, 50)
    late = model.block_cost(150, 50)
    assert early == pytest.approx(0.5)
    assert late == pytest.approx(1.0)
    assert model.block_cost(120, 0) == 0.0


def test_default_profile_is_superlinear_and_matches_the_documented_anchor() -> None:
    model = default_cost_model()
    assert model.points == list(DEFAULT_CPU_PROFILE)
    assert model.prefill_time(604) == pytest.approx(1.9, rel=0.05)
    costs = [model.block_cost(prefix, 128) for prefix in (0, 512, 1024, 1920)]
    assert costs == sorted(costs) and costs[0] < costs[-1]


@pytest.mark.parametrize(
    "points",
    [
        [(0, 0.0)],
        [(0, 0.0), (0, 1.0)],
        [(-1, 0.0), (5, 1.0)],
        [(0, 1.0), (10, 0.5)],
        [(0, -1.0), (1, 0.0)],
    ],
)
def test_bad_profiles_are_value_errors(points: list[tuple[int, float]]) -> None:
    with pytest.raises(ValueError):
        PrefillCostModel(points)


def test_negative_token_counts_are_value_errors() -> None:
    with pytest.raises(ValueError):
        make_model().prefill_time(-1)
    with pytest.raises(ValueError):
        make_model().block_cost(-1, 4)
