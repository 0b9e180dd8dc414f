"""``CraftEngine(server=...)``'s ``ReuseReport`` tier tokens: 0 from a plain vLLM 0.32 stream
(no ``kv_transfer_params`` there), read and validated when a stream event carries them."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_server import FakeServer, running
from test_server_backend import chunks, make_engine, model_dir  # noqa: F401  (fixture)

from craft_rag.engine.backends.server.backend import step_output


def _repeat_report(fake: FakeServer, model_dir: Path) -> tuple[int, int, int]:  # noqa: F811
    with running(fake) as url:
        engine = make_engine(url, model_dir)
        try:
            engine.generate(chunks(), "what is w1x3?", max_tokens=2)
            report = engine.generate(chunks(), "what is w1x3?", max_tokens=2).report
        finally:
            engine.close()
    assert report.cached_tokens > 0
    return report.cached_tokens, report.tier_ram_tokens, report.tier_disk_tokens


def test_a_plain_stream_reports_no_tier_tokens(model_dir: Path) -> None:  # noqa: F811
    _cached, ram, disk = _repeat_report(FakeServer(), model_dir)
    assert (ram, disk) == (0, 0)


def test_tier_counts_on_a_stream_event_reach_the_report(model_dir: Path) -> None:  # noqa: F811
    fake = FakeServer(kv_transfer_params={"craft_tiers": {"ram_tokens": 4, "disk_tokens": 4}})
    cached, ram, disk = _repeat_report(fake, model_dir)
    assert (ram, disk) == (4, 4) and cached >= 8


@pytest.mark.parametrize(
    "params",
    [
        {"craft_tiers": {"ram_tokens": "4", "disk_tokens": 0}},
        {"craft_tiers": {"ram_tokens": 4, "evil": 1}},
        {"craft_tiers": {"ram_tokens": 10**12, "disk_tokens": 0}},
        ["craft_tiers"],
    ],
)
def test_malformed_tier_counts_from_a_server_read_as_zero(
    model_dir: Path,  # noqa: F811
    params: object,
) -> None:
    _cached, ram, disk = _repeat_report(FakeServer(kv_transfer_params=params), model_dir)
    assert (ram, disk) == (0, 0)


def test_done_delta_without_tiers_is_zero() -> None:
    out = step_output("r", {"done": True, "finish_reason": "length", "cached_tokens": 8})
    assert (out.num_cached_tokens, out.tier_ram_tokens, out.tier_disk_tokens) == (8, 0, 0)
