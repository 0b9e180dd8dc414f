"""``craft-rag bench --trace FILE`` serves the whole file (issue 11 item 14): the suites' own
sizes (``overlap_requests`` = 60 with ``--quick``) used to cut a user's trace silently; only
``--requests N`` shortens it, and the count used is printed and recorded in every result.
Replay suites only (no engine); every file written is private (0600)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from craft_rag.chunk import make_chunk
from craft_rag.cli import main
from craft_rag.trace import TraceRequest, write_trace
from craft_rag_bench.bench.context import CUSTOM_TRACE, QUICK, BenchContext

LONGER_THAN_QUICK = QUICK.overlap_requests + 40  # 100


def make_trace(path: Path, requests: int) -> Path:
    pool = [make_chunk(f"Passage {i} says item {i} is from {1900 + i}.", id=f"p{i}")
            for i in range(10)]
    write_trace(
        (TraceRequest(f"q{i}", f"When is item {i % 10} from?",
                      (pool[i % 10], pool[(i + 3) % 10], pool[(i * 7) % 10]))
         for i in range(requests)),
        path,
    )
    return path


def test_context_serves_the_whole_trace_unless_capped(tmp_path: Path) -> None:
    trace = make_trace(tmp_path / "t.jsonl", LONGER_THAN_QUICK)
    ctx = BenchContext.create(quick=True, progress=False, trace_path=trace)
    assert len(ctx.trace(CUSTOM_TRACE, QUICK.overlap_requests)) == LONGER_THAN_QUICK
    capped = BenchContext.create(quick=True, progress=False, trace_path=trace, trace_requests=70)
    assert [r.id for r in capped.trace(CUSTOM_TRACE, 10)] == [f"q{i}" for i in range(70)]
    assert len(capped.trace(CUSTOM_TRACE, 10, top_k=2)[0].chunks) == 2


@pytest.mark.parametrize(("extra", "used"), [([], LONGER_THAN_QUICK), (["--requests", "70"], 70)])
def test_bench_cli_uses_and_reports_the_whole_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], used: int
) -> None:
    trace = make_trace(tmp_path / "t.jsonl", LONGER_THAN_QUICK)
    out = tmp_path / "results"
    code = main(["bench", "overlap", "--quick", "--trace", str(trace), "--out", str(out),
                 "--no-plots", "--no-progress", *extra])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"serving {used:,} of its {LONGER_THAN_QUICK:,} requests" in err
    result = json.loads((out / "overlap.json").read_text(encoding="utf-8"))
    assert result["trace_requests"] == used
    assert {row["requests"] for row in result["rows"] if "requests" in row} == {used}
    for name in ("overlap.json", "report.md"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
