"""The ``chunk-cache-speed`` suite's harness: the bound counted by hand, request rows from engine
reports (with and without chunk-cache counts), summaries, the time split, agreement, verdicts
and a whole ``--quick`` run through the bench CLI's ``run_suites`` on a tiny trace with a fake
worker (no engine, no process). The real run starts one engine process per system; it is run
by hand (docs/benchmarks.md, "Chunk-caches: speed")."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from craft_rag.chunk import make_chunk
from craft_rag.prompt import PromptAssembler, PromptFormat
from craft_rag.tokenizer import HashingTokenizer
from craft_rag.trace import TraceRequest, read_trace, write_trace
from craft_rag_bench.bench import chunk_cache_speed as speed
from craft_rag_bench.bench.chunk_cache_speed_worker import SpeedSpec, request_row
from craft_rag_bench.bench.cli import NOT_IN_ALL, SUITES, run_suites
from craft_rag_bench.bench.context import BenchContext

BLOCK = 4
FORMAT = PromptFormat(head="", chunk="{text} ", question="{question}", tail="")
"""One token per word and nothing around the chunks: chunk X is 4 tokens, the question 2."""


def chunk(name: str) -> Any:
    return make_chunk(" ".join(f"{name}{i}" for i in range(BLOCK)), id=name)


def request(i: int, *names: str) -> TraceRequest:
    return TraceRequest(id=f"q{i}", query="what now", chunks=tuple(chunk(n) for n in names))


def assembler() -> PromptAssembler:
    return PromptAssembler(HashingTokenizer(), FORMAT)


def test_bound_by_hand() -> None:
    # 1: [A B]; 2: [B A]; 3: [C D]; 4: [B C]. Total overlap: (2/2 + 0 + 1/2) / 3 = 0.5,
    # Prefix overlap: (0 + 0 + 1/2) / 3 (request 4 starts like request 2).
    trace = [request(1, "A", "B"), request(2, "B", "A"), request(3, "C", "D"),
             request(4, "B", "C")]
    b = speed.trace_bound(trace, assembler(), BLOCK)
    assert b["total_overlap"] == pytest.approx(0.5)
    assert b["computed_ceiling"] == pytest.approx(0.5)
    assert b["prefix_overlap"] == pytest.approx(1 / 6)
    assert b["prompt_tokens"] == 40
    # Seen before: request 2 both chunks (8), request 4 both (8): 16 of 40 tokens.
    assert b["seen_token_fraction"] == pytest.approx(16 / 40)
    # Exact prefix, nothing evicted: CRAFT puts A first in request 2 (8 of its 10 tokens hit,
    # the last prompt token never does) and B first in request 4 (4 tokens); the retriever's
    # order hits only request 4's B (request 2's B block was first computed there).
    assert b["unbounded_craft"] == pytest.approx(12 / 40)
    assert b["unbounded_prefix"] == pytest.approx(4 / 40)


@dataclass
class Report:
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float = 5.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["extra"][name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class Result:
    report: Report
    token_ids: tuple[int, ...] = (7, 8)
    prompt_token_ids: tuple[int, ...] = (1, 2, 3)


def test_request_row_takes_the_chunk_cache_counts_when_they_sum_to_the_prompt() -> None:
    counts = {"approximate": True, "exact_reused_tokens": 32, "fixed_tokens": 50,
              "recomputed_tokens": 20, "computed_tokens": 8, "chunk_cache_refused": None}
    row = request_row("q1", Result(Report(110, 32, extra=counts)))  # type: ignore[arg-type]
    assert (row["exact"], row["fixed"], row["recomputed"], row["computed"]) == (32, 50, 20, 8)
    assert row["approximate"] and row["counts_from"] == "report" and row["refused"] is None
    assert row["output_ids"] == [7, 8] and len(row["prompt_sha256"]) == 64
    # Counts that do not add up (or are missing: no chunk-caches) fall back to vLLM's cached.
    bad = {**counts, "computed_tokens": 9, "chunk_cache_refused": "no salt"}
    row = request_row("q2", Result(Report(110, 32, extra=bad)))  # type: ignore[arg-type]
    assert (row["exact"], row["fixed"], row["recomputed"], row["computed"]) == (32, 0, 0, 78)
    assert row["counts_from"] == "cached_tokens" and row["refused"] == "no salt"
    row = request_row("q3", Result(Report(110, 64)))  # type: ignore[arg-type]
    assert (row["exact"], row["computed"], row["approximate"]) == (64, 46, False)


def row(i: int, ttft: float, *, exact: int = 0, fixed: int = 0, recomputed: int = 0,
        computed: int = 100, out: tuple[int, ...] = (1,), approximate: bool = False,
        refused: str | None = None, prompt: str = "p") -> dict[str, Any]:
    return {"id": f"q{i}", "prompt_tokens": exact + fixed + recomputed + computed,
            "cached_tokens": exact + fixed + recomputed, "ttft_ms": ttft,
            "output_ids": list(out), "prompt_sha256": prompt + str(i),
            "approximate": approximate, "exact": exact, "fixed": fixed,
            "recomputed": recomputed, "computed": computed, "refused": refused,
            "counts_from": "report"}


def test_summarise_counts_tokens_by_origin_and_refusals() -> None:
    rows = [row(0, 100.0), row(1, 20.0, exact=50, fixed=30, recomputed=10, computed=10,
                                approximate=True),
            row(2, 60.0, exact=20, computed=80, refused="no chunk span"),
            row(3, 70.0, exact=20, computed=80, refused="no chunk span")]
    s = speed.summarise(rows)
    assert s["tokens"] == {"exact": 90, "fixed": 30, "recomputed": 10, "computed": 270}
    assert s["computed_fraction"] == pytest.approx(280 / 400)
    assert (s["approximate_requests"], s["refused_requests"]) == (1, 2)
    assert s["refusals"] == {"no chunk span": 2}
    assert s["mean_ttft_ms"] == 62.5 and s["time_split"] is None  # below 8 requests


def test_time_split_recovers_known_per_token_costs() -> None:
    # TTFT = 10 + 0.1 fixed + 2 recomputed + 1 computed, exactly: the fit returns those costs.
    rows = [row(i, 10 + 0.1 * f + 2 * r + 1 * c, fixed=f, recomputed=r, computed=c)
            for i, (f, r, c) in enumerate([(0, 0, 100), (100, 30, 20), (200, 60, 10),
                                           (50, 10, 70), (300, 90, 5), (10, 40, 30),
                                           (120, 5, 60), (80, 80, 80)])]
    split = speed.time_split(rows)
    assert split is not None
    assert split["ms_per_request"] == pytest.approx(10.0)
    assert split["ms_per_token"] == pytest.approx({"fixed": 0.1, "recomputed": 2.0,
                                                   "computed": 1.0})
    assert split["r2"] == pytest.approx(1.0)
    assert sum(split["share"].values()) == pytest.approx(1.0)
    recomputed = sum(2.0 * r["recomputed"] for r in rows) / sum(r["ttft_ms"] for r in rows)
    assert split["share"]["recomputed"] == pytest.approx(recomputed)
    assert split["unexplained_share"] == pytest.approx(0.0, abs=1e-9)
    # Only vLLM computed: the other origins are left out (cost None), vLLM's cost is fitted.
    only = speed.time_split([row(i, 10.0 + 2.0 * (50 + i), computed=50 + i) for i in range(8)])
    assert only is not None and only["ms_per_token"]["fixed"] is None
    assert only["ms_per_token"]["computed"] == pytest.approx(2.0)
    assert speed.time_split([row(i, 1.0, computed=0) for i in range(8)]) is None


def test_time_split_keeps_costs_non_negative() -> None:
    # Noise that an unconstrained fit would answer with a negative cost for ``computed``.
    rows = [row(i, t, fixed=f, recomputed=r, computed=c) for i, (t, f, r, c) in enumerate(
        [(100, 0, 10, 50), (90, 10, 10, 60), (120, 0, 12, 40), (80, 5, 8, 70),
         (130, 0, 13, 30), (70, 0, 7, 80), (110, 2, 11, 45), (95, 1, 9, 65)])]
    split = speed.time_split(rows)
    assert split is not None
    assert all(v is None or v >= 0 for v in split["ms_per_token"].values())
    assert split["ms_per_request"] >= 0


def test_agreement_compares_same_prompts_only() -> None:
    ref = [row(0, 1, out=(1, 2)), row(1, 1, out=(3,)), row(2, 1, out=(4,))]
    rows = [row(0, 1, out=(1, 2), approximate=True), row(1, 1, out=(9,), approximate=True),
            row(2, 1, out=(4,), prompt="other")]
    assert speed.agreement(ref, rows) == {"same_prompt": 2, "identical": 1, "approximate": 2,
                                          "approximate_identical": 1}


def test_verdicts_against_the_targets() -> None:
    systems: dict[str, dict[str, Any]] = {
        "craft": {"mean_ttft_ms": 300.0, "p50_ttft_ms": 200.0},
        "craft_chunk_cache": {"mean_ttft_ms": 150.0, "p50_ttft_ms": 100.0,
                              "computed_fraction": 0.2},
        "retriever_chunk_cache": {"mean_ttft_ms": 165.0, "p50_ttft_ms": 130.0}}
    v = speed.verdicts(systems, {"computed_ceiling": 0.3})
    assert v["craft_over_chunk_cache"] == {"mean_ttft_ratio": 2.0, "p50_ttft_ratio": 2.0,
                                           "target": 1.5, "met": True}
    r = v["retriever_over_craft_chunk_cache"]
    assert r["mean_ttft_ratio"] == pytest.approx(1.1) and r["met"] is False
    assert v["computed_below_ceiling"]["met"] is True
    systems["retriever_chunk_cache"] = {"error": "boom"}
    v = speed.verdicts(systems, {"computed_ceiling": 0.1})
    assert v["retriever_over_craft_chunk_cache"]["met"] is None
    assert v["computed_below_ceiling"]["met"] is False
    assert speed.verdicts({"craft": systems["craft"]}, None) == {}


def fake_worker(spec: SpeedSpec, *, workdir: Path) -> dict[str, Any]:
    """A worker without an engine: every request 100 tokens; chunk-caches serve half of the
    prompt fixed (retriever order: a quarter), at a fixed cost per token of each origin."""
    assert workdir.is_dir() and Path(spec.trace_path).is_file()
    assert (spec.rule, spec.fraction, spec.max_tokens) == (speed.RULE, speed.FRACTION,
                                                           speed.QUICK_MAX_TOKENS)
    rows = []
    for i, r in enumerate(read_trace(spec.trace_path)):
        if not spec.chunk_cache or i == 0:
            counts = {"exact": 20 if i else 0, "fixed": 0, "recomputed": 0,
                      "computed": 80 if i else 100}
        elif spec.planner == "tree":
            counts = {"exact": 20, "fixed": 50, "recomputed": 20, "computed": 10 + i % 3}
        else:
            counts = {"exact": 10, "fixed": 25, "recomputed": 10, "computed": 55 + i % 3}
        counts["exact"] = 100 - counts["fixed"] - counts["recomputed"] - counts["computed"]
        ttft = 5 + 0.1 * counts["fixed"] + 2 * counts["recomputed"] + counts["computed"]
        rows.append({"id": r.id, "prompt_tokens": 100, "cached_tokens": 100 - counts["computed"],
                     "ttft_ms": ttft, "output_ids": [1, 2], "prompt_sha256": f"{spec.planner}{i}",
                     "approximate": spec.chunk_cache and i > 0, **counts,
                     "refused": "first request" if spec.chunk_cache and i == 0 else None,
                     "counts_from": "report"})
    return {"system": spec.system, "engine_start_s": 1.0, "serve_s": 2.0, "requests": rows}


def test_quick_run_through_the_cli_writes_the_documented_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "chunk-cache-speed" in SUITES and "chunk-cache-speed" in NOT_IN_ALL
    names = "ABCDEFGH"
    trace = [request(i, names[i % 5], names[(i * 3 + 1) % 8]) for i in range(10)]
    path = tmp_path / "tiny.jsonl"
    write_trace(trace, path)
    monkeypatch.setattr(speed, "run_worker_process", fake_worker)
    ctx = BenchContext.create(quick=True, progress=False, trace_path=path, block_size=BLOCK)
    ctx._tokenizer, ctx._prompt_format = HashingTokenizer(), FORMAT
    out = tmp_path / "out"
    results = run_suites(ctx, ["chunk-cache-speed"], out, plots=False)
    saved = json.loads((out / "chunk-cache-speed.json").read_text(encoding="utf-8"))
    assert saved == results["chunk-cache-speed"]
    assert saved["systems"] == ["craft", "craft_chunk_cache", "retriever_chunk_cache"]
    w = saved["workloads"]["trace"]
    assert w["requests"] == 10 and set(w["bound"]) == {
        "prefix_overlap", "total_overlap", "computed_ceiling", "unbounded_craft",
        "unbounded_prefix", "seen_token_fraction", "prompt_tokens"}
    craft, blended = w["systems"]["craft"], w["systems"]["craft_chunk_cache"]
    assert craft["computed_fraction"] == pytest.approx((100 + 9 * 80) / 1000)
    assert craft["agreement"] is None
    assert craft["time_split"]["ms_per_token"]["computed"] == pytest.approx(1.0)
    assert craft["time_split"]["ms_per_token"]["fixed"] is None
    assert [r["id"] for r in blended["per_request"]] == [r.id for r in trace]
    assert blended["per_request"][1]["recomputed"] == 20
    assert blended["approximate_requests"] == 9 and blended["refusals"] == {"first request": 1}
    assert blended["agreement"] == {"same_prompt": 10, "identical": 10, "approximate": 9,
                                    "approximate_identical": 9}
    split = blended["time_split"]
    # fixed and recomputed move together here (collinear): the fit is exact, not unique.
    assert split["r2"] == pytest.approx(1.0) and split["requests"] == 10
    assert sum(split["share"].values()) == pytest.approx(1.0)
    assert w["systems"]["retriever_chunk_cache"]["agreement"]["same_prompt"] == 0
    v = w["verdicts"]
    assert v["craft_over_chunk_cache"]["mean_ttft_ratio"] == pytest.approx(
        craft["mean_ttft_ms"] / blended["mean_ttft_ms"])
    assert set(v) == {"craft_over_chunk_cache", "retriever_over_craft_chunk_cache",
                      "computed_below_ceiling"}
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "| craft_chunk_cache |" in report and "time split" in report


def test_a_failed_system_is_reported_and_the_others_still_run(tmp_path: Path) -> None:
    trace = [request(i, "A", "B") for i in range(3)]
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    base = SpeedSpec(system="", planner="", trace_path=str(path), block_size=BLOCK,
                     max_model_len=64, max_tokens=speed.QUICK_MAX_TOKENS)
    seen: list[str] = []

    def runner(spec: SpeedSpec) -> dict[str, Any]:
        seen.append(spec.system)
        if spec.chunk_cache and spec.planner == "tree":
            return {"error": "worker exited 1: no ChunkCacheSettings"}
        return fake_worker(spec, workdir=tmp_path)

    systems = speed.side_by_side(base, list(speed.SYSTEMS), runner)
    assert seen == list(speed.SYSTEMS)
    assert systems["craft_chunk_cache"] == {"error": "worker exited 1: no ChunkCacheSettings"}
    assert "mean_ttft_ms" in systems["retriever_chunk_cache"]
    assert speed.verdicts(systems, None) == {}
    assert "failed" in "\n".join(speed.report_lines({
        "rule": "r", "fraction": 0.3, "workloads": {"t": {
            "requests": 3, "bound": speed.trace_bound(trace, assembler(), BLOCK),
            "systems": systems, "verdicts": {}}}}))
    with pytest.raises(ValueError, match="valid"):
        speed.side_by_side(base, ["nope"], runner)


def test_spec_round_trips() -> None:
    spec = SpeedSpec(system="s", planner="tree", trace_path="/tmp/t", block_size=32,
                     max_model_len=4096, max_tokens=4, chunk_cache=True)
    assert SpeedSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="JSON object"):
        SpeedSpec.from_json("[1]")
