"""The ``pipeline`` suite (speculative retrieval pipelining) on the shared engine: one request
per system over a small synthetic IVF index, top-2 (CI smoke; about 10-20 s on 2 busy cores)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from craft_rag_bench.bench.cli import run_suites
from craft_rag_bench.bench.context import BenchContext

if TYPE_CHECKING:
    from craft_rag.engine import CraftEngine


@pytest.mark.engine
def test_pipeline_suite_quick(tmp_path: Path, craft_engine: CraftEngine) -> None:
    pytest.importorskip("faiss")
    ctx = BenchContext.create(quick=True, progress=False, engine=craft_engine)
    ctx.with_sizes(pipeline_requests=1, pipeline_vectors=4000, pipeline_nlist=16, pipeline_top_k=2)
    try:
        result = run_suites(ctx, ["pipeline"], tmp_path, plots=False)["pipeline"]
    finally:
        ctx.close()
    systems = result["systems"]
    assert set(systems) == {"search_then_prefill", "pipelined"}
    (base,) = result["rows"]["search_then_prefill"]
    (pipe,) = result["rows"]["pipelined"]
    assert base["cached_tokens"] == 0  # each request from an empty prefix cache
    assert pipe["speculations"] >= 1
    if pipe["reused"]:  # the speculation's prefill served the final request
        assert pipe["cached_tokens"] > 0
    assert result["same_prompt_fraction"] in (0.0, 1.0)
    assert (tmp_path / "pipeline.json").is_file()
    report = (tmp_path / "report.md").read_text("utf-8")
    assert "Speculative retrieval pipelining" in report and "| pipelined |" in report
