"""The ``load`` suite's admission comparison (issue 30): rates, SLO throughput, ratios and
verdicts on exact numbers, and the side-by-side run on fake engines (one per admission mode,
the cache-aware one handing vLLM-style priorities to its backend). The real run needs a
second engine with the priority scheduler; CI's shared engine cannot change its scheduler, so
the suite's handling of a lent engine is tested instead and the real run is in
docs/benchmarks.md."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from bench_cli_spy import spy_run_suites

from craft_rag.chunk import make_chunk
from craft_rag.engine import CraftEngine, EngineSettings
from craft_rag.testing import FakeBackend, make_fake_engine
from craft_rag.trace import TraceRequest
from craft_rag_bench.bench import load_admission
from craft_rag_bench.bench.context import QUICK, BenchContext
from craft_rag_bench.bench.load_admission import (
    compare,
    parse_factors,
    report_lines,
    run_admission,
    slo_throughput,
)
from craft_rag_bench.bench.report import _load


def test_parse_factors() -> None:
    assert parse_factors(" 2, 0.5,1,2 ") == (0.5, 1.0, 2.0)  # sorted, deduplicated
    assert parse_factors("none") == () == parse_factors(" None ")
    for bad in ("", "0", "-1,2", "a", "nan", "inf", ","):
        with pytest.raises(ValueError, match="--admission-factors"):
            parse_factors(bad)


def pt(rate: float, mean: float, p99: float | None = None, thr: float = 1.0,
       factor: float | None = None) -> dict[str, Any]:
    return {"rate": rate, "factor": factor, "mean_ttft_ms": mean,
            "p99_ttft_ms": mean * 2 if p99 is None else p99, "throughput_rps": thr}


def test_slo_throughput_interpolates_the_crossing() -> None:
    points = [pt(4.0, 900, thr=3.0), pt(1.0, 100, thr=0.9), pt(2.0, 300, thr=1.8)]
    got = slo_throughput(points, slo_ms=500)
    assert got["max_rate_within_slo"] == 2.0 and got["throughput_rps"] == 1.8
    assert got["throughput_at_slo_rps"] == pytest.approx(2.0 + (200 / 600) * 2.0)
    # Every rate within the SLO: the grid does not bracket it.
    assert slo_throughput(points, 1000)["throughput_at_slo_rps"] is None
    assert slo_throughput(points, 1000)["max_rate_within_slo"] == 4.0
    # The lowest rate already beyond it: nothing within.
    none = slo_throughput(points, 50)
    assert none == {"max_rate_within_slo": None, "throughput_rps": None,
                    "throughput_at_slo_rps": None}
    # A dip back under the SLO after a breach does not count (unbroken run from the lowest).
    dip = [pt(1.0, 100), pt(2.0, 600), pt(4.0, 400)]
    assert slo_throughput(dip, 500)["max_rate_within_slo"] == 1.0


def test_compare_ratios_saturation_and_verdicts() -> None:
    fcfs = [pt(1.0, 150, 300, 0.9, 0.5), pt(2.0, 400, 900, 1.5, 1.0),
            pt(4.0, 1200, 2000, 2.0, 2.0)]
    aware = [pt(1.0, 140, 320, 0.9, 0.5), pt(2.0, 250, 1000, 1.8, 1.0),
             pt(4.0, 800, 3500, 2.6, 2.0)]
    got = compare({"fcfs": fcfs, "cache_aware": aware}, low_load_ttft_ms=100, slo_ms=500)
    rows = {r["rate"]: r for r in got["per_rate"]}
    assert [r["saturated"] for r in got["per_rate"]] == [False, True, True]  # >= 2 x 100 ms
    assert got["saturated_rates"] == [2.0, 4.0]
    assert rows[2.0]["mean_ttft_ratio"] == pytest.approx(400 / 250)
    assert rows[4.0]["p99_ttft_ratio"] == pytest.approx(3500 / 2000)
    assert rows[1.0]["factor"] == 0.5 and rows[4.0]["throughput_ratio"] == pytest.approx(1.3)
    v = got["verdicts"]
    assert v["min_mean_ttft_ratio_saturated"] == pytest.approx(1.5)  # 1200/800, 400/250
    assert v["mean_ttft_met"] is True
    assert v["max_p99_ratio"] == pytest.approx(1.75) and v["p99_met"] is False
    fcfs_slo = 2.0 + (100 / 800) * 2.0
    aware_slo = 2.0 + (250 / 550) * 2.0
    assert got["at_slo"]["fcfs"]["throughput_at_slo_rps"] == pytest.approx(fcfs_slo)
    assert v["throughput_at_slo_ratio"] == pytest.approx(aware_slo / fcfs_slo)
    assert v["throughput_at_slo_met"] is True
    # No saturating rate, an unbracketed SLO: no verdict rather than a made-up one.
    calm = compare({"fcfs": fcfs[:1], "cache_aware": aware[:1]}, 100, 10_000)
    assert calm["verdicts"]["mean_ttft_met"] is None
    assert calm["verdicts"]["throughput_at_slo_met"] is None
    assert calm["verdicts"]["p99_met"] is True


def shared_trace(requests: int = 10, seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    pool = [make_chunk(" ".join(f"w{rng.randrange(200)}" for _ in range(16)), id=f"p{i}")
            for i in range(6)]
    single = [TraceRequest(id=f"q{i}", query=f"Question {i}?", chunks=tuple(rng.sample(pool, 3)))
              for i in range(requests)]
    turn = TraceRequest(id="c#1", query="Hi?", chunks=(pool[0],), conversation_id="c", turn=1)
    return [*single, turn]


def test_side_by_side_on_fake_engines(tmp_path: Any) -> None:
    from craft_rag.trace import write_trace

    trace_path = tmp_path / "t.jsonl"
    write_trace(shared_trace(), trace_path)
    made: list[tuple[str, FakeBackend]] = []

    @contextmanager
    def engines(mode: str) -> Iterator[CraftEngine]:
        backend = FakeBackend(max_model_len=1024, step_delay=0.001)
        made.append((mode, backend))
        engine, _ = make_fake_engine(backend, settings=EngineSettings(admission=mode))
        try:
            yield engine
        finally:
            engine.close()

    ctx = BenchContext(sizes=QUICK, quick=True, progress=False, trace_path=trace_path)
    ctx.with_sizes(admission_factors=(0.5, 4.0), ttft_max_tokens=2)
    adm = run_admission(ctx, engines)
    assert "skipped" not in adm and adm["modes"] == ["fcfs", "cache_aware"]
    assert [m for m, _ in made] == ["fcfs", "cache_aware"]  # one engine per mode, in turn
    assert all(b.shut_down for _, b in made)
    fcfs_backend, aware_backend = made[0][1], made[1][1]
    # The cache-aware engine gives every request a priority; FCFS admission is off.
    assert set(fcfs_backend.priorities.values()) == {None}
    assert aware_backend.priorities and None not in aware_backend.priorities.values()
    w = adm["workloads"]["trace"]
    assert w["requests"] == 10  # the conversation turn is left out
    assert w["factors"] == [0.5, 4.0]
    assert w["rates"] == pytest.approx([f / w["service_s"] for f in (0.5, 4.0)])
    assert w["slo_ms"] == pytest.approx(5 * w["low_load_ttft_ms"])
    for mode in ("fcfs", "cache_aware"):
        pts = w["points"][mode]
        assert [p["rate"] for p in pts] == w["rates"]
        assert all(p["requests"] == 10 and p["mean_ttft_ms"] > 0 for p in pts)
        assert all(0.0 < p["cached_token_fraction"] < 1.0 for p in pts)  # shared passages
    # Served one request at a time (low-load) the fake sends 10 requests plus a warm-up;
    # then 2 rates x (10 + warm-up) per mode.
    assert len(fcfs_backend.added) == 11 + 2 * 11 and len(aware_backend.added) == 2 * 11
    assert {r["rate"] for r in w["per_rate"]} == set(w["rates"])
    assert set(w["verdicts"]) == {"min_mean_ttft_ratio_saturated", "mean_ttft_met",
                                  "throughput_at_slo_ratio", "throughput_at_slo_met",
                                  "max_p99_ratio", "p99_met"}
    text = "\n".join(report_lines(adm))
    assert "Admission, trace: 10 requests, craft_tree, window 32" in text
    assert "throughput at the SLO cache_aware / fcfs" in text


def test_a_lent_engine_or_no_factors_skip_the_comparison() -> None:
    engine, backend = make_fake_engine()
    try:
        ctx = BenchContext(sizes=QUICK, progress=False, engine=engine)
        adm = run_admission(ctx)
        assert "scheduler" in adm["skipped"] and adm["workloads"] == {}
        assert ctx.engine is engine and not backend.shut_down
        assert report_lines(adm)[0].startswith("Admission comparison skipped")
        ctx.with_sizes(admission_factors=())
        assert "--admission-factors none" in run_admission(ctx)["skipped"]
    finally:
        engine.close()


def test_load_report_keeps_old_results_and_adds_the_comparison() -> None:
    old = {"points": [{"system": "craft_tree", "rate": 1.0, "mean_ttft_ms": 1.0,
                       "p50_ttft_ms": 1.0, "p99_ttft_ms": 1.0, "throughput_rps": 1.0,
                       "cached_token_fraction": 0.5}],
           "at_slo": {"craft_tree": {"max_rate_within_slo": 1.0, "throughput_rps": 1.0}},
           "slo_ms": 10.0}
    lines = _load(old)  # a result written before the comparison: no admission key
    assert not any("Admission" in x for x in lines)
    skipped = {**old, "admission": {"skipped": "no rates (--admission-factors none)"}}
    assert _load(skipped)[-1] == (
        "Admission comparison skipped: no rates (--admission-factors none).")


def test_cli_admission_factors_reach_the_suite_sizes(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from craft_rag.cli import build_parser
    from craft_rag_bench.bench import cli

    seen = spy_run_suites(monkeypatch)
    for flag, want in (("8,1", (1.0, 8.0)), ("none", ())):
        args = build_parser().parse_args(
            ["bench", "load", "--admission-factors", flag, "--out", str(tmp_path / "out")])
        assert cli.run_bench(args) == 0
        assert seen[-1].sizes.admission_factors == want
    assert BenchContext().sizes.admission_factors == (0.5, 1.0, 2.0, 4.0)
    args = build_parser().parse_args(["bench", "load", "--admission-factors", "0,1"])
    with pytest.raises(ValueError, match="--admission-factors"):
        cli.run_bench(args)
    assert load_admission.Targets(1.2, 1.15, 1.5) == load_admission.TARGETS
