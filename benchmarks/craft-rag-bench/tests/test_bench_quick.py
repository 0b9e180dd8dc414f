"""Smoke tests of ``craft-rag bench``: the replay suites and the overhead suite at tiny sizes on
a synthetic trace (no retrieval, no engine; seconds), the JSON/PNG/report outputs, the metric
helpers, and one engine-marked run of the ttft suite with 3 requests on the shared engine.
No timing assertions: the machine may be shared."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from craft_rag.chunk import make_chunk
from craft_rag.trace import TraceRequest, write_trace
from craft_rag_bench.bench.cli import SUITES, run_suites
from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.load import poisson_arrivals
from craft_rag_bench.bench.peers import available_peers
from craft_rag_bench.bench.qa_metrics import exact_match, normalize_answer, paired_t_test, token_f1
from craft_rag_bench.bench.report import render_report
from craft_rag_bench.bench.sensitivity import mean_table_size

if TYPE_CHECKING:
    from craft_rag.engine import CraftEngine

SUITE_NAMES = {"overlap", "kv", "ttft", "load", "topk", "sensitivity", "quality", "overhead",
               "routing", "chat", "cache-sizes", "tiers", "chunk-cache", "pipeline",
               "chunk-cache-speed"}


def make_trace(path: Path, requests: int = 24, seed: int = 0) -> Path:
    """Single-turn requests over a pool of 12 short chunks (shared, in shuffled orders) plus a
    two-turn conversation, in the replay format."""
    rng = random.Random(seed)
    pool = [
        make_chunk(f"Passage {i} says that item {i} was made in year {1900 + i}.", id=f"p{i}")
        for i in range(12)
    ]
    out = []
    for i in range(requests):
        chunks = rng.sample(pool[: 4 + i % 8], 3)
        out.append(TraceRequest(id=f"q{i}", query=f"When was item {i % 12} made?",
                                chunks=tuple(chunks), answer=str(1900 + i % 12)))
    for turn in (1, 2):
        out.append(TraceRequest(id=f"c#{turn}", query=f"Tell me more ({turn}).",
                                chunks=(pool[0], pool[turn]), conversation_id="c", turn=turn,
                                answer="More."))
    write_trace(out, path)
    return path


def test_suites_registry_covers_the_issue() -> None:
    assert set(SUITES) == SUITE_NAMES


def test_replay_suites_and_overhead_quick(tmp_path: Path) -> None:
    trace = make_trace(tmp_path / "trace.jsonl")
    ctx = BenchContext.create(quick=True, progress=False, trace_path=trace)
    ctx.with_sizes(overhead_distinct=2_000, sensitivity_requests=26, overlap_requests=26)
    out = tmp_path / "results"
    results = run_suites(ctx, ["overlap", "sensitivity", "overhead"], out)

    overlap = results["overlap"]
    rows = {r["policy"]: r for r in overlap["rows"]}
    craft = {name for name, r in rows.items() if not r["peer"]}
    assert craft == {"retriever", "frequency", "tree"}
    # Issue 16: the peers' rows, on the same replay, marked (offline ContextPilot sees ahead).
    assert set(rows) - craft == set(available_peers())
    assert all(r["sees_future"] == (n == "contextpilot_offline") for n, r in rows.items())
    assert {x["peer"] for x in overlap["tree_vs_peers"]} == set(available_peers())
    for row in rows.values():
        assert row["workload"] == "trace"
        assert 0.0 <= row["prefix_overlap"] <= row["total_overlap"] <= 1.0
        assert row["retrieved_total_overlap"] == pytest.approx(rows["retriever"]["total_overlap"])
    # Reordering cannot beat the order-free bound, and the shuffled orders leave room for it.
    assert rows["tree"]["prefix_overlap"] >= rows["retriever"]["prefix_overlap"]

    sens = results["sensitivity"]
    sweeps = {(r["sweep"], r["policy"]) for r in sens["rows"]}
    assert sweeps == {("window", "frequency"), ("window", "tree"),
                      ("threshold", "frequency"), ("threshold", "tree")}

    over = results["overhead"]
    assert len(over["rows"]) == 8 and over["distinct_chunks"] == 2_000
    for row in over["rows"]:
        assert row["gc_frozen"] is True and row["replay_requests"] > 0
        assert 0 < row["cpu_us_p50"] <= row["cpu_us_p99"]
        assert 0 < row["replay_us_p50"] <= row["replay_us_p99"]
        # plan+commit alone inside the replay: part of the whole turn timed around it
        assert 0 < row["replay_plan_commit_us_p50"] <= row["replay_plan_commit_us_p99"]
        assert row["replay_plan_commit_us_p50"] < row["replay_us_p50"]

    for name in ("overlap", "sensitivity", "overhead"):
        saved = json.loads((out / f"{name}.json").read_text())
        assert saved["suite"] == name and saved["quick"] is True
        assert (out / f"{name}.png").stat().st_size > 1000
    report = (out / "report.md").read_text()
    assert "Prefix vs Total" in report and "Planner overhead" in report


def test_mean_table_size_counts_distinct_chunks_in_window() -> None:
    a, b, c = (make_chunk(t, id=t) for t in "abc")
    trace = [TraceRequest(id=str(i), query="q", chunks=cs)
             for i, cs in enumerate([(a, b), (b, c), (c,)])]
    # windows of 1: 2, 2, 1 distinct; unlimited: 2, 3, 3
    assert mean_table_size(trace, 1) == pytest.approx(5 / 3)
    assert mean_table_size(trace, None) == pytest.approx(8 / 3)


def test_squad_normalisation_em_f1() -> None:
    assert normalize_answer("The  Denver Broncos!") == "denver broncos"
    assert exact_match("the Denver broncos.", ["Denver Broncos", "Broncos"]) == 1.0
    assert exact_match("Carolina", ["Denver Broncos"]) == 0.0
    assert token_f1("Denver", ["Denver Broncos"]) == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert token_f1("", ["Denver"]) == 0.0


def test_paired_t_test_matches_the_textbook_statistic() -> None:
    a = [0.5, 0.7, 0.2, 0.9, 0.4, 0.6]
    b = [0.4, 0.7, 0.3, 0.6, 0.4, 0.5]
    d = [x - y for x, y in zip(a, b, strict=True)]
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
    result = paired_t_test(a, b)
    assert result.t == pytest.approx(mean / (sd / math.sqrt(len(d))))
    assert result.p is not None and 0.0 < result.p < 1.0
    assert paired_t_test([1.0, 1.0], [1.0, 1.0]).p == 1.0
    with pytest.raises(ValueError, match="equal length"):
        paired_t_test([1.0], [1.0, 2.0])


def test_builtin_t_tail_matches_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    from craft_rag_bench.bench.qa_metrics import _student_two_sided

    for t, df in ((0.5, 19), (2.1, 5), (4.0, 2)):
        assert _student_two_sided(t, df) == pytest.approx(2 * stats.t.sf(t, df), rel=1e-6)


def test_poisson_arrivals_are_seeded_and_increasing() -> None:
    a = poisson_arrivals(50, 2.0, seed=1)
    assert a == poisson_arrivals(50, 2.0, seed=1)
    assert a[0] == 0.0 and all(x < y for x, y in itertools.pairwise(a))
    assert 10 < a[-1] < 50  # ~49 gaps of mean 0.5 s


def test_report_skips_missing_suites() -> None:
    text = render_report({}, {"machine": "test"})
    assert text.startswith("# craft-rag benchmark report") and "##" not in text


@pytest.mark.engine
def test_ttft_suite_on_the_shared_engine(tmp_path: Path, craft_engine: CraftEngine) -> None:
    trace = make_trace(tmp_path / "trace.jsonl", requests=3)
    # A --trace file is served whole (issue 11 item 14); cap it to its 3 single-turn requests
    # so the single-turn columns (no_cache baseline, Total-overlap bound) are the ones checked.
    ctx = BenchContext.create(
        quick=True, progress=False, trace_path=trace, engine=craft_engine, trace_requests=3
    )
    ctx.with_sizes(ttft_requests=3, mtrag_turns=3, ttft_max_tokens=1)
    results = run_suites(ctx, ["ttft"], tmp_path / "results", plots=False)
    ctx.close()  # an engine passed in stays open
    workload = results["ttft"]["workloads"]["trace"]
    systems = workload["systems"]
    # the four side-by-side systems, then the peers served on the same engine (issue 16)
    assert list(systems) == [
        "no_cache", "prefix_cache", "craft_frequency", "craft_tree", *available_peers()
    ]
    assert workload["baseline"] == "no_cache"
    assert all(s["requests"] == 3 for s in systems.values())
    assert systems["no_cache"]["cached_tokens"] == 0
    assert systems["no_cache"]["normalised_mean"] == pytest.approx(1.0)
    assert workload["total_overlap_bound"] is not None
    craft_engine.generate([make_chunk("Still serving.", id="after")], "Alive?", max_tokens=1)
