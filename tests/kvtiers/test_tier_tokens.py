"""``tier_tokens_of``: the connector's per-request tier counts read back from
``kv_transfer_params``, trusting nothing but non-negative ints under the two known keys."""

from __future__ import annotations

import pytest

from craft_rag.kvtiers.tier_tokens import TIER_PARAMS_KEY, tier_tokens_of


def test_reads_ram_and_disk_tokens() -> None:
    params = {TIER_PARAMS_KEY: {"ram_tokens": 32, "disk_tokens": 16}, "other": {"x": 1}}
    assert tier_tokens_of(params) == (32, 16)
    assert tier_tokens_of({TIER_PARAMS_KEY: {"disk_tokens": 16}}) == (0, 16)  # missing key: 0


@pytest.mark.parametrize("params", [None, {}, "craft_tiers", [1, 2], {"other": 1}])
def test_no_tier_counts_read_as_zero(params: object) -> None:
    assert tier_tokens_of(params) == (0, 0)


@pytest.mark.parametrize(
    "counts",
    [
        {"ram_tokens": -1, "disk_tokens": 0},
        {"ram_tokens": True, "disk_tokens": 0},
        {"ram_tokens": 1.5, "disk_tokens": 0},
        {"ram_tokens": "16", "disk_tokens": 0},
        {"ram_tokens": 16, "disk_tokens": None},
        {"ram_tokens": 16, "pool_tokens": 3},  # unknown key
        [16, 0],
        "16",
    ],
)
def test_malformed_counts_read_as_zero_without_raising(counts: object) -> None:
    assert tier_tokens_of({TIER_PARAMS_KEY: counts}) == (0, 0)


def test_counts_past_the_prompt_length_are_ignored() -> None:
    params = {TIER_PARAMS_KEY: {"ram_tokens": 48, "disk_tokens": 16}}
    assert tier_tokens_of(params, maximum=64) == (48, 16)
    assert tier_tokens_of(params, maximum=63) == (0, 0)


def test_connector_reexports_the_key() -> None:
    pytest.importorskip("vllm")
    from craft_rag.kvtiers import connector

    assert connector.TIER_PARAMS_KEY == TIER_PARAMS_KEY
