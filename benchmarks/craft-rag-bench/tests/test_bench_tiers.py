"""The ``tiers`` suite's pure parts: pool sizing, summaries, exactness, hit ratio, verdicts, the
side-by-side loop over a fake worker runner (no engine, no process) and the JSON layout. The
real run starts one engine process per system (minutes); it is run by hand
(docs/benchmarks.md, "KV tiers")."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from bench_cli_spy import spy_run_suites

from craft_rag_bench.bench import tiers
from craft_rag_bench.bench.cache_sizes import WorkingSet
from craft_rag_bench.bench.cli import NOT_IN_ALL, SUITES, finite_json
from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.tiers import (
    SYSTEMS,
    TARGETS,
    engine_max_len,
    exactness,
    pool_blocks,
    report_lines,
    side_by_side,
    summarise_requests,
    tier_tokens,
    verdicts,
)
from craft_rag_bench.bench.tiers_worker import (
    WorkerSpec,
    connector_extra_config,
    connector_stats,
    prompt_digest,
    record_tier_counts,
)
from craft_rag_bench.bench.tiers_worker import tier_tokens as request_tier_tokens


def ws_of(request_blocks: int, mean: float, largest: int, block: int = 32) -> WorkingSet:
    return WorkingSet(requests=30, block_size=block, request_blocks=request_blocks,
                      distinct_blocks=request_blocks // 2, mean_request_blocks=mean,
                      max_request_blocks=largest)


def test_pool_holds_about_n_mean_prompts_within_bounds() -> None:
    ws = ws_of(730, 24.33, 36)
    assert pool_blocks(ws, 4) == 98 == -(-4 * 24.33 // 1)
    assert pool_blocks(ws, 1) == 37  # at least the largest request plus one block
    assert pool_blocks(ws, 1000) == 730 + 36  # never above the whole working set
    with pytest.raises(ValueError, match="--pool-requests"):
        pool_blocks(ws, 0)


def test_engine_max_len_fits_the_pool_and_the_longest_request() -> None:
    ws = ws_of(730, 24.33, 36)
    assert engine_max_len(4096, 98, ws) == 97 * 32  # one block spare
    assert engine_max_len(2048, 98, ws) == 2048
    with pytest.raises(ValueError, match="--max-model-len 1000"):
        engine_max_len(1000, 98, ws)


def req(i: int, cached: int, ttft: float, out: tuple[int, ...] = (1, 2), prompt: str = "p",
        tokens: int = 100, ram: int | None = None, disk: int | None = None) -> dict[str, Any]:
    return {"id": f"q{i}", "prompt_tokens": tokens, "cached_tokens": cached, "ttft_ms": ttft,
            "output_ids": list(out), "prompt_sha256": prompt_digest([i, len(prompt)]) + prompt,
            "ram_tokens": ram, "disk_tokens": disk}


def test_summarise_requests() -> None:
    rows = [req(0, 0, 100.0), req(1, 50, 20.0), req(2, 100, 30.0, tokens=200)]
    s = summarise_requests(rows)
    assert (s["requests"], s["prompt_tokens"], s["cached_tokens"]) == (3, 400, 150)
    assert s["cached_token_fraction"] == 150 / 400
    assert s["mean_ttft_ms"] == 50.0
    assert (s["p50_ttft_ms"], s["p99_ttft_ms"]) == (30.0, 100.0)
    assert summarise_requests([])["cached_token_fraction"] == 0.0


def test_exactness_compares_same_prompts_and_counts_tier_hits() -> None:
    ref = [req(0, 0, 1.0), req(1, 32, 1.0), req(2, 0, 1.0), req(3, 0, 1.0), req(4, 0, 1.0)]
    rows = [
        req(0, 0, 1.0),  # same prompt, no gain: identical, not a tier hit
        req(1, 96, 1.0),  # tier hit (+64), identical
        req(2, 64, 1.0, out=(9,)),  # tier hit (+64), output differs
        req(3, 64, 1.0, prompt="other"),  # another order: not comparable
        {**req(4, 0, 1.0), "id": "z"},  # another request: not compared
    ]
    e = exactness(ref, rows)
    assert e == {"compared": 4, "same_prompt": 3, "identical": 2, "tier_hit_requests": 2,
                 "tier_hit_identical": 1, "tier_extra_cached_tokens": 128, "mismatched": ["q2"]}


def test_exactness_uses_the_connector_counts_when_known() -> None:
    ref = [req(0, 32, 1.0), req(1, 32, 1.0)]
    # q0: the tier served 32 tokens the pool no longer had (same total as craft): a tier hit.
    # q1: more cached than craft but no tier tokens (a pool hit craft's pool had lost): not one.
    rows = [req(0, 32, 1.0, ram=0, disk=32), req(1, 64, 1.0, ram=0, disk=0)]
    e = exactness(ref, rows)
    assert (e["tier_hit_requests"], e["tier_hit_identical"]) == (1, 1)
    assert e["tier_extra_cached_tokens"] == 0


def test_tier_tokens_and_hit_ratio() -> None:
    rows = [req(0, 64, 1.0, tokens=100, ram=32, disk=0),  # pool 32, tiers 32 of 68 missed
            req(1, 0, 1.0, tokens=100, ram=0, disk=0),  # 100 missed, none served
            req(2, 96, 1.0, tokens=100, ram=32, disk=64)]  # pool 0, tiers 96 of 100 missed
    t = tier_tokens(rows)
    assert (t["ram_tokens"], t["disk_tokens"], t["tier_tokens"]) == (64, 64, 128)
    assert t["tier_hit_ratio"] == pytest.approx(128 / (68 + 100 + 100))
    unknown = tier_tokens([*rows, req(3, 0, 1.0)])
    assert unknown == {"ram_tokens": None, "disk_tokens": None, "tier_tokens": None,
                       "tier_hit_ratio": None}
    assert tier_tokens([req(0, 100, 1.0, ram=0, disk=0)])["tier_hit_ratio"] is None


def test_request_finished_counts_are_recorded_by_both_request_ids() -> None:
    class Request:
        request_id = "craft-7-1a2b3c4d"  # vLLM's internal id: the submitted one + 8 characters

    class Connector:
        def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
            return False, {"craft_tiers": {"ram_tokens": 32, "disk_tokens": 64}}

    connector = Connector()
    counts = record_tier_counts(connector)
    assert connector.request_finished(Request(), [1]) == (
        False, {"craft_tiers": {"ram_tokens": 32, "disk_tokens": 64}})  # passed through
    assert counts == {"craft-7-1a2b3c4d": {"ram_tokens": 32, "disk_tokens": 64},
                      "craft-7": {"ram_tokens": 32, "disk_tokens": 64}}
    assert request_tier_tokens(counts, "craft-7", tiered=True) == {"ram_tokens": 32,
                                                                   "disk_tokens": 64}
    assert request_tier_tokens(counts, "craft-8", tiered=True) == {"ram_tokens": None,
                                                                   "disk_tokens": None}
    assert request_tier_tokens(counts, "craft-7", tiered=False)["ram_tokens"] is None
    assert record_tier_counts(None) == {}


def system(cached: float, ttft: float, hit: float | None = None, hits: int = 0,
           same: int = 0) -> dict[str, Any]:
    return {"cached_token_fraction": cached, "mean_ttft_ms": ttft, "tier_hit_ratio": hit,
            "exactness": {"tier_hit_requests": hits, "tier_hit_identical": same}}


def test_verdicts_against_the_targets() -> None:
    v = verdicts({
        "prefix": system(0.2, 500.0),
        "craft": system(0.3, 400.0),
        "craft_tier_lru": system(0.45, 300.0, hit=0.5, hits=60, same=60),
        "craft_tier_pgdsf": system(0.6, 250.0, hit=0.6, hits=60, same=59),
    })
    lru, pgdsf = v["craft_tier_lru"], v["craft_tier_pgdsf"]
    assert lru["cached_ratio"] == pytest.approx(1.5) and lru["cached_met"]
    assert lru["ttft_speedup"] == pytest.approx(400 / 300) and lru["ttft_met"]
    assert lru["exact_met"] and lru["exact_all_identical"]
    assert pgdsf["cached_ratio"] == pytest.approx(2.0)
    assert not pgdsf["exact_met"] and not pgdsf["exact_all_identical"]  # one output differs
    assert v["pgdsf_vs_lru"]["hit_ratio_ratio"] == pytest.approx(1.2)
    assert v["pgdsf_vs_lru"]["hit_ratio_met"] is True
    # Below the targets; unknown hit ratios give None, not a verdict.
    low = verdicts({"craft": system(0.3, 400.0),
                    "craft_tier_lru": system(0.4, 350.0, hits=10, same=10),
                    "craft_tier_pgdsf": system(0.4, 350.0)})
    assert low["craft_tier_lru"]["cached_met"] is False
    assert low["craft_tier_lru"]["ttft_met"] is False
    assert low["craft_tier_lru"]["exact_met"] is False  # 10 < 50
    assert low["pgdsf_vs_lru"]["hit_ratio_ratio"] is None
    assert low["pgdsf_vs_lru"]["hit_ratio_met"] is None
    # A failed system gives no verdict; no reference, no tier-vs-craft verdicts.
    assert "craft_tier_lru" not in verdicts({"craft": system(0.3, 400.0),
                                             "craft_tier_lru": {"error": "boom"}})
    assert verdicts({"craft_tier_lru": system(0.4, 1.0)}) == {}
    assert TARGETS.exact_requests == 50 and TARGETS.cached_ratio == 1.5


class FakeRunner:
    """Stands in for the worker process: records specs, checks each tier system's disk folder
    exists (private, empty) while it runs, and returns rows where tiers cache more."""

    def __init__(self, fail: str | None = None) -> None:
        self.specs: list[WorkerSpec] = []
        self.fail = fail

    def __call__(self, spec: WorkerSpec) -> dict[str, Any]:
        self.specs.append(spec)
        if spec.system == self.fail:
            return {"error": "worker exited 1: no connector"}
        if spec.disk_dir is not None:
            folder = Path(spec.disk_dir)
            assert folder.is_dir() and not any(folder.iterdir())
            assert (folder.stat().st_mode & 0o777) == 0o700
            (folder / "block.kv").write_bytes(b"x" * 10)
        gain = {"prefix": 0, "craft": 20, "craft_tier_lru": 50, "craft_tier_pgdsf": 60}
        tier = gain[spec.system] - 20 if spec.policy else None
        disk = 0 if spec.policy else None
        rows = [req(i, gain[spec.system] if i else 0, 100.0 - gain[spec.system],
                    ram=tier if i else disk, disk=disk)
                for i in range(3)]
        stats = {"ram_hits": gain[spec.system]}
        return {"system": spec.system, "engine_start_s": 1.0, "serve_s": 2.0,
                "connector": stats if spec.policy else None, "requests": rows}


def base_spec(trace: Path) -> WorkerSpec:
    return WorkerSpec(system="", planner="", trace_path=str(trace), blocks=98, block_size=32,
                      max_model_len=3104, max_tokens=4, ram_bytes=1 << 30, disk_bytes=4 << 30)


def test_side_by_side_one_worker_per_system_fresh_private_disk(tmp_path: Path) -> None:
    runner = FakeRunner()
    rows = side_by_side(base_spec(tmp_path / "t.jsonl"), list(SYSTEMS), runner, tmp_path)
    assert [s.system for s in runner.specs] == list(SYSTEMS)
    assert [s.planner for s in runner.specs] == ["retriever", "tree", "tree", "tree"]
    assert [s.policy for s in runner.specs] == [None, None, "lru", "pgdsf"]
    dirs = [s.disk_dir for s in runner.specs if s.disk_dir]
    assert len(set(dirs)) == 2 and not any(Path(d).exists() for d in dirs)  # removed after
    assert all(s.blocks == 98 and s.ram_bytes == 1 << 30 for s in runner.specs)
    assert list(rows) == list(SYSTEMS)
    assert "tier_policy" not in rows["craft"] and rows["craft_tier_lru"]["tier_policy"] == "lru"
    # pgdsf: 2 requests x 40 tier tokens; the pool lacked 100 + 2 x (100 - 60 + 40)
    assert rows["craft_tier_pgdsf"]["tier_hit_ratio"] == pytest.approx(80 / 260)
    assert rows["craft_tier_pgdsf"]["tier_stats"] == {"ram_hits": 60}
    assert rows["craft_tier_lru"]["disk_dir_bytes"] == 10
    exact = rows["craft_tier_lru"]["exactness"]
    assert exact["tier_hit_requests"] == 2 and exact["tier_hit_identical"] == 2
    assert connector_extra_config(runner.specs[3]) == {
        "ram_bytes": 1 << 30, "disk_bytes": 4 << 30, "disk_dir": runner.specs[3].disk_dir,
        "policy": "pgdsf"}
    with pytest.raises(ValueError, match="no tier policy"):
        connector_extra_config(runner.specs[0])
    with pytest.raises(ValueError, match="valid"):
        side_by_side(base_spec(tmp_path / "t.jsonl"), ["craft", "nope"], runner, tmp_path)


def test_a_failed_system_is_reported_and_the_others_still_run(tmp_path: Path) -> None:
    rows = side_by_side(base_spec(tmp_path / "t.jsonl"), list(SYSTEMS),
                        FakeRunner(fail="craft_tier_lru"), tmp_path)
    assert rows["craft_tier_lru"] == {"error": "worker exited 1: no connector"}
    assert "error" not in rows["craft_tier_pgdsf"]
    v = verdicts(rows)
    assert "craft_tier_lru" not in v and "pgdsf_vs_lru" not in v and "craft_tier_pgdsf" in v
    assert any("failed" in line for line in report_lines(layout(rows)))


def layout(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"suite": "tiers", "pool_requests": 4, "tier_ram_bytes": 1 << 30,
            "tier_disk_bytes": 4 << 30,
            "workloads": {"trace": {"requests": 3, "pool_blocks": 98, "pool_tokens": 3136,
                                    "systems": rows, "verdicts": verdicts(rows)}}}


SYSTEM_FIELDS = {"requests", "prompt_tokens", "cached_tokens", "cached_token_fraction",
                 "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "engine_start_s", "serve_s"}
TIER_FIELDS = SYSTEM_FIELDS | {"tier_policy", "ram_tokens", "disk_tokens", "tier_tokens",
                               "tier_hit_ratio", "tier_stats", "exactness", "disk_dir_bytes"}


def test_json_layout_is_stable(tmp_path: Path) -> None:
    """The field names docs/benchmarks.md documents."""
    rows = side_by_side(base_spec(tmp_path / "t.jsonl"), list(SYSTEMS), FakeRunner(), tmp_path)
    assert set(rows["prefix"]) == set(rows["craft"]) == SYSTEM_FIELDS
    assert set(rows["craft_tier_lru"]) == set(rows["craft_tier_pgdsf"]) == TIER_FIELDS
    v = verdicts(rows)
    assert set(v) == {"craft_tier_lru", "craft_tier_pgdsf", "pgdsf_vs_lru"}
    assert set(v["craft_tier_lru"]) == {"cached_ratio", "cached_met", "ttft_speedup",
                                        "ttft_met", "exact_tier_hits", "exact_all_identical",
                                        "exact_met"}
    assert set(v["pgdsf_vs_lru"]) == {"hit_ratio_ratio", "hit_ratio_met", "cached_ratio"}
    text = json.dumps(finite_json(layout(rows)), allow_nan=False)  # strict JSON
    assert json.loads(text)["workloads"]["trace"]["systems"]["craft"]["requests"] == 3
    lines = report_lines(layout(rows))
    pgdsf = next(line for line in lines if line.startswith("| craft_tier_pgdsf | "))
    assert "| 80 / 0 |" in pgdsf and "| 2/2 |" in pgdsf
    assert next(line for line in lines if line.startswith("| craft | ")).endswith("| - | - | - |")
    assert any("PGDSF vs LRU" in line for line in lines)


def test_connector_stats_probe() -> None:
    @dataclass
    class Stats:
        ram_hits: int = 2

    class Store:
        def stats(self) -> Stats:
            return Stats()

    class WithStore:
        store = Store()

    class WorkerRole:
        @property
        def store(self) -> Store:
            raise RuntimeError("the store lives in the scheduler-role connector")

    assert connector_stats(None) is None
    assert connector_stats(object()) is None
    assert connector_stats(WorkerRole()) is None
    assert connector_stats(WithStore()) == {"ram_hits": 2}


def test_worker_spec_round_trips() -> None:
    spec = base_spec(Path("/tmp/t.jsonl"))
    assert WorkerSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="JSON object"):
        WorkerSpec.from_json("[1]")


def test_tiers_is_a_suite_that_all_skips_and_a_lent_engine_skips_it() -> None:
    assert "tiers" in SUITES and "tiers" in NOT_IN_ALL
    class Lent:
        planner = None

    lent: Any = Lent()
    ctx = BenchContext(engine=lent)
    out = tiers.run(ctx)
    assert "skipped" in out and out["workloads"] == {}
    assert report_lines(out)[0].startswith("Skipped")


def test_cli_options_reach_the_suite_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from craft_rag.cli import build_parser
    from craft_rag_bench.bench import cli

    seen = spy_run_suites(monkeypatch)
    args = build_parser().parse_args(
        ["bench", "tiers", "--pool-requests", "3", "--tier-ram-mib", "256",
         "--tier-disk-mib", "1024", "--out", str(tmp_path / "out")])
    assert cli.run_bench(args) == 0
    sizes = seen[0].sizes
    assert (sizes.tiers_pool_requests, sizes.tiers_ram_bytes, sizes.tiers_disk_bytes) == (
        3, 256 << 20, 1 << 30)
    defaults = BenchContext().sizes
    assert (defaults.tiers_ram_bytes, defaults.tiers_disk_bytes, defaults.tiers_requests) == (
        1 << 30, 4 << 30, 300)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "tiers", "--pool-requests", "0"])
