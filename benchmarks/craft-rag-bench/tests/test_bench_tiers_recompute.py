"""``--verify-tier-hits``: the worker's re-run of tier-hit prompts from scratch (over a fake
engine) and the parent's bookkeeping (:func:`recompute_check`, verdicts, ``--systems``). No
engine starts here; the real run is by hand (docs/benchmarks.md, "KV tiers")."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from bench_cli_spy import spy_run_suites

from craft_rag.engine import TokensRequest
from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.tiers import (
    SYSTEMS,
    report_lines,
    selected_systems,
    side_by_side,
    verdicts,
)
from craft_rag_bench.bench.tiers_recompute import MAX_IDS, recompute_check
from craft_rag_bench.bench.tiers_worker import (
    TierCounts,
    WorkerSpec,
    is_tier_hit,
    recompute_tier_hits,
)


def row(i: int, ram: int | None, disk: int | None, out: tuple[int, ...] = (1, 2),
        again: dict[str, Any] | None = None, rerun: bool = True) -> dict[str, Any]:
    r: dict[str, Any] = {"id": f"q{i}", "prompt_tokens": 100, "cached_tokens": 64,
                         "ttft_ms": 1.0, "output_ids": list(out), "prompt_sha256": str(i),
                         "ram_tokens": ram, "disk_tokens": disk}
    if rerun:
        r["recompute"] = again
    return r


def scratch(out: tuple[int, ...] = (1, 2), cached: int = 0, ram: int | None = 0,
            disk: int | None = 0) -> dict[str, Any]:
    return {"output_ids": list(out), "cached_tokens": cached, "ram_tokens": ram,
            "disk_tokens": disk}


def test_tier_hit_needs_known_positive_tier_tokens() -> None:
    assert is_tier_hit(row(0, 32, 0)) and is_tier_hit(row(0, 0, 32))
    assert not is_tier_hit(row(0, 0, 0))
    assert not is_tier_hit(row(0, None, None))  # unknown counts: not a hit
    assert not is_tier_hit(row(0, 32, None))


def test_recompute_check_counts_each_outcome() -> None:
    rows = [
        row(0, 0, 0),  # no tier tokens: not a tier hit, whatever its re-run
        row(1, 32, 0, again=scratch()),  # verified, identical
        row(2, 0, 64, again=scratch()),  # verified, identical (disk)
        row(3, 32, 32, out=(1, 3), again=scratch()),  # verified, output differs
        row(4, 32, 0, again=scratch(cached=32)),  # re-run reused the pool: not from scratch
        row(5, 32, 0, again=scratch(ram=32)),  # re-run loaded from a tier: not from scratch
        row(6, 32, 0, again=scratch(ram=None, disk=None)),  # unknown counts: not verified
        row(7, 32, 0, again=None),  # a tier hit the worker did not re-run
        row(8, 32, 0, rerun=False),  # no key at all (the worker was stopped first)
    ]
    assert recompute_check(rows) == {
        "tier_hit_requests": 8, "verified_requests": 3, "identical_to_recompute": 2,
        "all_identical": False, "mismatched_ids": ["q3"],
        "not_from_scratch_ids": ["q4", "q5", "q6"], "unverified_ids": ["q7", "q8"]}


def test_recompute_check_all_identical_and_off() -> None:
    rows = [row(i, 32, 0, again=scratch()) for i in range(3)] + [row(3, 0, 0)]
    check = recompute_check(rows)
    assert check is not None and check["all_identical"]
    assert (check["tier_hit_requests"], check["verified_requests"],
            check["identical_to_recompute"]) == (3, 3, 3)
    assert recompute_check([row(0, 32, 0, rerun=False)]) is None  # the option was off
    none = recompute_check([row(0, 0, 0, again=None)])
    assert none is not None and not none["all_identical"]  # no tier hit proves nothing
    many = recompute_check([row(i, 32, 0, out=(9,), again=scratch()) for i in range(30)])
    assert many is not None and len(many["mismatched_ids"]) == MAX_IDS
    assert many["verified_requests"] == 30 and many["identical_to_recompute"] == 0


@dataclass
class Report:
    request_id: str
    cached_tokens: int


@dataclass
class Result:
    token_ids: tuple[int, ...]
    report: Report


@dataclass
class Handle:
    value: Result

    def result(self) -> Result:
        return self.value


@dataclass
class FakeEngine:
    """Answers each prompt with its last token twice; a prompt ending in 7 gets another
    answer, and one ending in 8 reports cached and tier tokens (as if not from scratch).
    Records the connector's counts for each re-run as the wrapped ``request_finished``
    would."""

    counts: TierCounts
    seen: list[TokensRequest] = field(default_factory=list)

    def submit(self, request: TokensRequest) -> Handle:
        self.seen.append(request)
        rid = f"craft-{len(self.seen)}"
        last = request.token_ids[-1]
        loaded = 32 if last == 8 else 0
        self.counts[rid] = {"ram_tokens": loaded, "disk_tokens": 0}
        out = (last, 0) if last == 7 else (last, last)
        return Handle(Result(out, Report(rid, loaded)))


def test_worker_reruns_only_tier_hits_from_scratch_with_the_exact_ids() -> None:
    counts: TierCounts = {}
    engine = FakeEngine(counts)
    rows = [row(0, 0, 0, out=(4, 4), rerun=False), row(1, 32, 0, out=(5, 5), rerun=False),
            row(2, 0, 32, out=(7, 7), rerun=False), row(3, 32, 0, out=(8, 8), rerun=False)]
    prompts = [(1, 2, 4), (3, 5), (6, 7), (9, 8)]
    recompute_tier_hits(engine, rows, prompts, counts, max_tokens=8)  # type: ignore[arg-type]
    assert [r.token_ids for r in engine.seen] == [(3, 5), (6, 7), (9, 8)]
    assert all(not r.sampling.read_prefix_cache and r.sampling.max_tokens == 8
               and r.sampling.temperature == 0.0 for r in engine.seen)
    assert rows[0]["recompute"] is None
    assert rows[1]["recompute"] == scratch(out=(5, 5))
    assert rows[3]["recompute"] == scratch(out=(8, 8), cached=32, ram=32)
    assert recompute_check(rows) == {
        "tier_hit_requests": 3, "verified_requests": 2, "identical_to_recompute": 1,
        "all_identical": False, "mismatched_ids": ["q2"], "not_from_scratch_ids": ["q3"],
        "unverified_ids": []}
    with pytest.raises(ValueError):  # one prompt per row
        recompute_tier_hits(engine, rows, prompts[:2], counts, 8)  # type: ignore[arg-type]


def test_verdict_against_recompute_needs_no_reference_and_50_identical() -> None:
    def verified(n: int, differ: int = 0) -> dict[str, Any]:
        rows = [row(i, 32, 0, out=(9,) if i < differ else (1, 2), again=scratch())
                for i in range(n)]
        return {"cached_token_fraction": 0.5, "mean_ttft_ms": 1.0,
                "tier_hit_verification": recompute_check(rows)}

    assert verdicts({"craft_tier_pgdsf": verified(50)}) == {
        "craft_tier_pgdsf": {"recompute_identical": 50, "recompute_met": True}}
    assert not verdicts({"craft_tier_pgdsf": verified(49)})["craft_tier_pgdsf"]["recompute_met"]
    one_off = verdicts({"craft_tier_pgdsf": verified(60, differ=1)})["craft_tier_pgdsf"]
    assert one_off == {"recompute_identical": 59, "recompute_met": False}
    # With craft too, the same-prompt verdict keeps its fields and gains these two.
    both = verdicts({"craft": {"cached_token_fraction": 0.5, "mean_ttft_ms": 1.0},
                     "craft_tier_lru": verified(50)})["craft_tier_lru"]
    assert both["recompute_met"] and both["cached_ratio"] == 1.0


class RerunRunner:
    """A worker whose tier systems re-ran their tier hits (as with ``verify_tier_hits``)."""

    def __init__(self) -> None:
        self.specs: list[WorkerSpec] = []

    def __call__(self, spec: WorkerSpec) -> dict[str, Any]:
        self.specs.append(spec)
        tiered = spec.policy is not None
        rows = [row(i, 32 * i if tiered else None, 0 if tiered else None,
                    again=scratch() if tiered and i else None, rerun=spec.verify_tier_hits)
                for i in range(3)]
        return {"system": spec.system, "engine_start_s": 1.0, "serve_s": 2.0,
                "verify_s": 3.0, "connector": None, "requests": rows}


def test_side_by_side_with_a_subset_of_systems_and_verification(tmp_path: Path) -> None:
    base = WorkerSpec(system="", planner="", trace_path=str(tmp_path / "t.jsonl"), blocks=98,
                      block_size=32, max_model_len=3104, max_tokens=4, ram_bytes=1 << 20,
                      disk_bytes=1 << 20, verify_tier_hits=True)
    runner = RerunRunner()
    rows = side_by_side(base, ["craft_tier_pgdsf"], runner, tmp_path)
    assert [s.system for s in runner.specs] == ["craft_tier_pgdsf"]
    assert runner.specs[0].verify_tier_hits
    pgdsf = rows["craft_tier_pgdsf"]
    assert pgdsf["exactness"] is None  # craft did not run
    assert pgdsf["verify_s"] == 3.0
    assert pgdsf["tier_hit_verification"]["identical_to_recompute"] == 2
    assert verdicts(rows)["craft_tier_pgdsf"]["recompute_identical"] == 2
    lines = report_lines({"pool_requests": 4, "tier_ram_bytes": 1 << 20,
                          "tier_disk_bytes": 1 << 20, "workloads": {"trace": {
                              "requests": 3, "pool_blocks": 98, "pool_tokens": 3136,
                              "systems": rows, "verdicts": verdicts(rows)}}})
    assert "- craft_tier_pgdsf: 2 of 2 tier hits recomputed from scratch identical" in "\n".join(
        lines)
    assert ("- craft_tier_pgdsf vs a recompute from scratch: 2 identical tier hits (met: False)"
            in lines)
    off = side_by_side(replace(base, verify_tier_hits=False), ["craft", "craft_tier_lru"],
                       RerunRunner(), tmp_path)
    assert "tier_hit_verification" not in off["craft_tier_lru"]  # fields only with the option
    assert "verify_s" not in off["craft_tier_lru"]


def test_selected_systems_keeps_the_suite_order() -> None:
    assert selected_systems(()) == list(SYSTEMS)
    assert selected_systems(["craft_tier_pgdsf", "craft"]) == ["craft", "craft_tier_pgdsf"]
    with pytest.raises(ValueError, match="valid: prefix, craft, craft_tier_lru"):
        selected_systems(["craft", "pgdsf"])


def test_cli_systems_and_verify_reach_the_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from craft_rag.cli import build_parser
    from craft_rag_bench.bench import cli

    seen = spy_run_suites(monkeypatch)
    args = build_parser().parse_args(
        ["bench", "tiers", "--systems", "craft_tier_pgdsf, craft", "--verify-tier-hits",
         "--out", str(tmp_path / "out")])
    assert cli.run_bench(args) == 0
    sizes = seen[0].sizes
    assert sizes.tiers_systems == ("craft", "craft_tier_pgdsf")
    assert sizes.tiers_verify_tier_hits
    defaults = BenchContext().sizes
    assert defaults.tiers_systems == () and not defaults.tiers_verify_tier_hits
    bad = build_parser().parse_args(["bench", "tiers", "--systems", "lru",
                                     "--out", str(tmp_path / "out2")])
    with pytest.raises(ValueError, match="valid"):
        cli.run_bench(bad)
