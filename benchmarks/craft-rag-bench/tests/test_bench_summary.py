"""``craft_rag_bench.demo.request_summary``: the one set of per-system aggregates the demo, the
``tiers`` suite and the ``routing`` replicas report."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace
from typing import Any, cast

from craft_rag_bench.demo import SystemResult, request_summary, summarise


def test_request_summary_values() -> None:
    s = request_summary([100.0, 20.0, 30.0], 400, 150)
    assert s == {
        "requests": 3,
        "prompt_tokens": 400,
        "cached_tokens": 150,
        "cached_token_fraction": 150 / 400,
        "mean_ttft_ms": 50.0,
        "p50_ttft_ms": 30.0,
        "p99_ttft_ms": 100.0,
    }
    empty = request_summary([], 0, 0)
    assert (empty["requests"], empty["cached_token_fraction"], empty["mean_ttft_ms"]) == (
        0, 0.0, 0.0,
    )


def _result(ttft: float, prompt: int, cached: int, removed: int, dropped: int) -> Any:
    report = SimpleNamespace(
        ttft_ms=ttft, prompt_tokens=prompt, cached_tokens=cached,
        removed_duplicates=("k",) * removed, dropped_turns=dropped,
    )
    return SimpleNamespace(report=report)


def test_summarise_is_the_request_summary_plus_dedup_and_dropped_turns() -> None:
    results = [_result(100.0, 100, 0, 1, 0), _result(20.0, 100, 50, 0, 2),
               _result(30.0, 200, 100, 2, 1)]
    s = summarise(cast(Any, results))
    assert {f.name for f in fields(SystemResult)} == set(request_summary([], 0, 0)) | {
        "dedup_removed_chunks", "dropped_turns",
    }
    expected = request_summary([100.0, 20.0, 30.0], 400, 150)
    assert {k: getattr(s, k) for k in expected} == expected
    assert (s.dedup_removed_chunks, s.dropped_turns) == (3, 3)
