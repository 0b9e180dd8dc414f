"""The ``ttft`` suite's fairness statistics (issue 16): mirrored passes, per-request rows, the
token fit and the request-by-request pairing (pure functions on synthetic results), and the
suite itself on a fake engine (``craft_rag.testing``): the layout it adds, the serving order of
``--ttft-passes 2`` and the first pass shared with the other suites. The real engine runs the
suite in ``test_bench_quick.py``."""

from __future__ import annotations

import gc
import json
import random
from pathlib import Path
from typing import Any

import pytest

from craft_rag.chunk import make_chunk
from craft_rag.cli import build_parser
from craft_rag.engine import GenerationResult, ReuseReport
from craft_rag.testing import make_fake_engine
from craft_rag.trace import TraceRequest, write_trace
from craft_rag_bench.bench import ttft
from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.report import render_report
from craft_rag_bench.bench.ttft_stats import (
    fit_mean,
    fit_rows,
    gc_pauses,
    mirrored_order,
    paired,
    per_request,
    serve_passes,
    summary_row,
)


def make_trace(path: Path, requests: int) -> Path:
    """Single-turn requests drawing 3 of 6 shared passages in random orders (replay format)."""
    rng = random.Random(0)
    pool = [make_chunk(f"Passage {i} says item {i} was made in {1900 + i}.", id=f"p{i}")
            for i in range(6)]
    write_trace([TraceRequest(id=f"q{i}", query=f"When was item {i} made?",
                              chunks=tuple(rng.sample(pool, 3))) for i in range(requests)], path)
    return path


def result(prompt: int, cached: int, ttft_ms: float) -> GenerationResult:
    report = ReuseReport(
        request_id="r", prompt_tokens=prompt, cached_tokens=cached, predicted_tokens=None,
        predicted_chunks=0, reused_chunks=0, prefix_tokens=0, ttft_ms=ttft_ms,
        latency_ms=ttft_ms + 1, output_tokens=1, chunk_order=(), removed_duplicates=(),
        repeated_in_request=(), dropped_turns=0, conversation_id=None, turn=1,
        read_prefix_cache=True,
    )
    return GenerationResult(text="", token_ids=(), finish_reason="length", report=report)


def line(computed: int, noise: float = 0.0) -> float:
    """A TTFT model: 50 ms + 1 ms per computed token (+ noise)."""
    return 50.0 + computed + noise


def run_of(prompts: list[int], cached: list[int], noise: list[float]) -> list[GenerationResult]:
    return [result(p, c, line(p - c, e)) for p, c, e in zip(prompts, cached, noise, strict=True)]


def test_mirrored_order() -> None:
    assert mirrored_order(["a", "b", "c"], 1) == ["a", "b", "c"]
    assert mirrored_order(["a", "b", "c"], 2) == ["a", "b", "c", "c", "b", "a"]
    assert mirrored_order(["a", "b"], 3) == ["a", "b", "b", "a", "a", "b"]
    for bad in (0, 9, -1):
        with pytest.raises(ValueError, match="--ttft-passes"):
            mirrored_order(["a"], bad)


def test_summary_row_runs_over_every_pass() -> None:
    one = [result(100, 0, 10.0), result(100, 64, 30.0)]
    two = [result(100, 0, 50.0), result(100, 64, 110.0)]
    row = summary_row([one, two])
    assert row["passes"] == 2
    assert row["mean_ttft_ms"] == pytest.approx(50.0)  # (10 + 30 + 50 + 110) / 4
    assert row["mean_ttft_ms_per_pass"] == pytest.approx([20.0, 80.0])
    assert row["p50_ttft_ms"] > 10.0 and row["p99_ttft_ms"] > 100.0
    assert row["prompt_tokens"] == 200 and row["cached_tokens"] == 64  # one pass, not summed
    assert row["cached_tokens_per_pass"] == [64, 64]
    assert summary_row([one])["mean_ttft_ms"] == pytest.approx(20.0)
    with pytest.raises(ValueError, match="at least one pass"):
        summary_row([])


def test_fit_recovers_the_line_and_the_pairing_splits_tokens_from_noise() -> None:
    prompts = [400, 600, 800, 500]
    # "tree" caches more on request 1, less on request 3; one slow request (+300 ms noise).
    tree = per_request([run_of(prompts, [128, 320, 256, 0], [0, 0, 300, 0])])
    peer = per_request([run_of(prompts, [128, 256, 256, 32], [0, 0, 0, 0])])
    assert tree["prompt_tokens"] == prompts and tree["cached_tokens"] == [[128, 320, 256, 0]]
    a, b = fit_rows({"peer": peer})  # noise-free: exact
    assert (a, b) == (pytest.approx(50.0), pytest.approx(1.0))
    fit = (50.0, 1.0)
    assert fit_mean(peer, fit) == pytest.approx(50 + (272 + 344 + 544 + 468) / 4)
    got = paired(tree, peer, fit)
    assert got["requests_more_computed"] == 1 and got["requests_fewer_computed"] == 1
    assert got["computed_tokens_diff"] == pytest.approx(-64 + 32)
    assert got["fit_ttft_diff_ms"] == pytest.approx(-32 / 4)
    assert got["mean_ttft_diff_ms"] == pytest.approx((300 - 32) / 4)
    assert got["unexplained_ms"] == pytest.approx(300 / 4)  # the slow request, not the order
    diffs = [0.0, -64.0, 300.0, 32.0]
    mean = sum(diffs) / 4
    se = (sum((d - mean) ** 2 for d in diffs) / 3 / 4) ** 0.5
    assert got["mean_ttft_diff_se_ms"] == pytest.approx(se)
    assert got["mean_ttft_diff_ms_per_pass"] == pytest.approx([mean])
    assert got["largest_gaps"][0] == {"request": 2, "ttft_diff_ms": 300.0,
                                      "computed_tokens_diff": 0}
    with pytest.raises(ValueError, match="same trace"):
        paired(tree, per_request([run_of([1], [0], [0])]), fit)


def test_pairing_averages_passes() -> None:
    prompts = [300, 300]
    first = run_of(prompts, [0, 0], [100, 0])
    second = run_of(prompts, [0, 0], [-100, 0])
    rows = per_request([first, second])
    assert rows["ttft_ms"] == [[450.0, 350.0], [250.0, 350.0]]
    base = per_request([run_of(prompts, [0, 0], [0, 0])])
    got = paired(rows, base, (50.0, 1.0))
    assert got["mean_ttft_diff_ms"] == pytest.approx(0.0)
    # one pass of base: pass 1 against pass 1 only; the drift shows between passes
    assert got["mean_ttft_diff_ms_per_pass"] == pytest.approx([50.0])
    both = per_request([run_of(prompts, [0, 0], [0, 0]), run_of(prompts, [0, 0], [0, 0])])
    assert paired(rows, both, (50.0, 1.0))["mean_ttft_diff_ms_per_pass"] == pytest.approx(
        [50.0, -50.0])


def test_serve_passes_mirrors_and_counts_collections() -> None:
    calls: list[tuple[str, int]] = []

    def serve(name: str, index: int) -> list[GenerationResult]:
        calls.append((name, index))
        if name == "b":
            cycle: list[Any] = []
            cycle.append(cycle)
            del cycle
            gc.collect()
        return [result(10, 0, 1.0)]

    runs, info = serve_passes(["a", "b"], 2, serve)
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1)]
    assert [len(runs[n]) for n in ("a", "b")] == [2, 2]
    assert info["b"][0]["gc_collections"] >= 1 and info["b"][0]["gc_gen2_collections"] >= 1
    assert info["a"][0]["gc_collections"] == 0  # the pre-pass collection is not counted
    assert len(info["a"][0]["load_avg_1min"]) == 2 and info["a"][1]["seconds"] >= 0
    with gc_pauses() as stats:
        pass
    assert stats["collections"] == 0


def test_one_pass_collects_nothing_before_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    collected: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation) or 0)
    serve_passes(["a", "b"], 1, lambda name, index: [result(10, 0, 1.0)])
    assert collected == []  # bench all's cost unchanged
    serve_passes(["a", "b"], 2, lambda name, index: [result(10, 0, 1.0)])
    assert collected == [2, 2, 2, 2]  # one full collection before each pass


def test_cli_flag_sets_the_passes() -> None:
    args = build_parser().parse_args(["bench", "ttft", "--ttft-passes", "2"])
    assert args.ttft_passes == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "ttft", "--ttft-passes", "0"])


@pytest.mark.parametrize("passes", [1, 2])
def test_suite_on_a_fake_engine(tmp_path: Path, passes: int) -> None:
    trace = make_trace(tmp_path / "trace.jsonl", requests=6)
    engine, _ = make_fake_engine()
    try:
        ctx = BenchContext(progress=False, engine=engine, trace_path=trace, trace_requests=6)
        ctx.with_sizes(ttft_max_tokens=1, ttft_passes=passes)
        out = ttft.run(ctx)
        w = out["workloads"]["trace"]
        names = list(w["systems"])
        assert names[:4] == ["no_cache", "prefix_cache", "craft_frequency", "craft_tree"]
        assert w["passes"] == passes
        assert w["serving_order"] == (names if passes == 1 else [*names, *reversed(names)])
        for name, row in w["systems"].items():
            assert row["passes"] == passes and len(row["mean_ttft_ms_per_pass"]) == passes
            assert row["requests"] == 6 and row["prompt_tokens"] > 0
            # deterministic orders: every pass caches the same tokens
            assert len(set(row["cached_tokens_per_pass"])) == 1
            assert row["residual_mean_ms"] == pytest.approx(
                row["mean_ttft_ms"] - row["fit_mean_ttft_ms"])
            assert len(w["pass_info"][name]) == passes
            per = w["per_request"][name]
            assert len(per["prompt_tokens"]) == 6 and len(per["ttft_ms"]) == passes
        assert set(w["tree_vs"]) == set(names) - {"craft_tree"}
        tree_vs = w["tree_vs"]["prefix_cache"]
        assert tree_vs["computed_tokens_diff"] == pytest.approx(
            w["systems"]["craft_tree"]["computed_tokens"]
            - w["systems"]["prefix_cache"]["computed_tokens"])
        # the first pass is the one the kv/quality suites reuse
        assert len(ctx.runs) == len(names)
        json.dumps(out, allow_nan=False)
        text = render_report({"ttft": {**out, "machine": {}}}, {"machine": "test"})
        assert "craft_tree vs prefix_cache" in text
    finally:
        engine.close()
