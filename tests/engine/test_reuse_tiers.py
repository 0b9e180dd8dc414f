"""``ReuseReport`` splits cached tokens by source (pool, RAM tier, disk tier) from what the
backend's KV connector reports on the finished request (simulated by ``FakeBackend``)."""

from __future__ import annotations

import pytest

from craft_rag.engine import SamplingRequest
from craft_rag.testing import FakeBackend, make_chunks, make_fake_engine


def _repeat_report(params: object) -> tuple[int, int, int, int]:
    backend = FakeBackend(kv_transfer_params=params)  # type: ignore[arg-type]
    engine, _ = make_fake_engine(backend=backend)
    try:
        chunks = make_chunks(3)
        engine.generate(chunks, "Which?", max_tokens=2)
        report = engine.generate(chunks, "Which?", max_tokens=2).report
    finally:
        engine.close()
    assert report.cached_tokens > 0
    return report.cached_tokens, report.tier_ram_tokens, report.tier_disk_tokens, report.pool_tokens


def test_report_splits_cached_tokens_by_source() -> None:
    params = {"craft_tiers": {"ram_tokens": 16, "disk_tokens": 16}}
    cached, ram, disk, pool = _repeat_report(params)
    assert (ram, disk) == (16, 16)
    assert pool == cached - 32


def test_without_a_connector_every_cached_token_is_from_the_pool() -> None:
    cached, ram, disk, pool = _repeat_report(None)
    assert (ram, disk, pool) == (0, 0, cached)


@pytest.mark.parametrize(
    "params",
    [
        {"craft_tiers": {"ram_tokens": -16, "disk_tokens": 0}},
        {"craft_tiers": {"ram_tokens": 16, "bogus": 1}},
        {"craft_tiers": {"ram_tokens": 10**9, "disk_tokens": 0}},  # more than the prompt
    ],
)
def test_malformed_or_impossible_tier_counts_report_zero(params: object) -> None:
    cached, ram, disk, pool = _repeat_report(params)
    assert (ram, disk, pool) == (0, 0, cached)


def test_tier_counts_beyond_the_cached_tokens_report_zero() -> None:
    # Within the prompt but more than vLLM says it had cached: the counts disagree.
    backend = FakeBackend(kv_transfer_params={"craft_tiers": {"ram_tokens": 16, "disk_tokens": 0}})
    engine, _ = make_fake_engine(backend=backend)
    try:
        first = engine.generate(make_chunks(3), "Which?", max_tokens=2).report
    finally:
        engine.close()
    assert first.cached_tokens == 0
    assert (first.tier_ram_tokens, first.tier_disk_tokens, first.pool_tokens) == (0, 0, 0)


def test_tokens_request_reports_tier_tokens_too() -> None:
    backend = FakeBackend(kv_transfer_params={"craft_tiers": {"ram_tokens": 16, "disk_tokens": 0}})
    engine, _ = make_fake_engine(backend=backend)
    try:
        ids = list(range(10, 60))
        engine.generate_tokens(ids, sampling=SamplingRequest(max_tokens=2))
        report = engine.generate_tokens(ids, sampling=SamplingRequest(max_tokens=2)).report
    finally:
        engine.close()
    assert report.cached_tokens >= 16
    assert report.tier_ram_tokens == 16
