"""The ``pipeline`` suite's index options (``--pipeline-index``, ``--pipeline-dim``) and its
overlap bound: real faiss indexes at a tiny size, no engine (about 1-3 s)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_cli_spy import spy_run_suites

from craft_rag.cli import build_parser
from craft_rag.scheduling.pipelining import IVFStagedSearch
from craft_rag_bench.bench import pipeline
from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.pipeline import check_index_type, overlap_bound, timed

faiss = pytest.importorskip("faiss")


def test_cli_flags_set_index_and_dim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from craft_rag_bench.bench import cli

    seen = spy_run_suites(monkeypatch)
    args = build_parser().parse_args(
        ["bench", "pipeline", "--pipeline-index", "sq8", "--pipeline-dim", "384",
         "--out", str(tmp_path / "out")])
    assert cli.run_bench(args) == 0
    assert (seen[-1].sizes.pipeline_index, seen[-1].sizes.pipeline_dim) == ("sq8", 384)
    assert (BenchContext().sizes.pipeline_index, BenchContext().sizes.pipeline_dim) == (
        "flat", 128)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "pipeline", "--pipeline-index", "hnsw"])
    args = build_parser().parse_args(
        ["bench", "pipeline", "--pipeline-index", "pq", "--pipeline-dim", "100",
         "--out", str(tmp_path / "out")])
    with pytest.raises(ValueError, match="divisible by 8"):
        cli.run_bench(args)


def test_check_index_type() -> None:
    assert check_index_type("pq", 64) == "pq"
    assert check_index_type("flat", 100) == "flat"
    with pytest.raises(ValueError, match="flat, sq8, pq"):
        check_index_type("ivf", 64)


@pytest.mark.parametrize(("kind", "code_size"), [("flat", 128), ("sq8", 32), ("pq", 4)])
def test_build_corpus_each_index(
    kind: str, code_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pipeline, "BATCH", 1000)  # several batches: query rows in any of them
    ctx = BenchContext.create(quick=True, progress=False)
    ctx.with_sizes(pipeline_requests=4, pipeline_vectors=3500, pipeline_nlist=16,
                   pipeline_dim=32, pipeline_index=kind)
    try:
        corpus = pipeline.build_corpus(ctx)
        asked = pipeline.queries(ctx, corpus)
    finally:
        ctx.close()
    index = corpus.index
    assert isinstance(index, faiss.IndexIVF) and index.ntotal == 3500
    assert (index.code_size, index.nprobe, index.nlist) == (code_size, 16, 16)
    assert len(corpus.sources) == len(asked) == 4
    staged = IVFStagedSearch(index, stages=4)
    for row, source in corpus.sources.items():
        assert 0 <= row < 3500 and source.shape == (32,)
        # The kept vector is the indexed one: it finds itself (pq: among its nearest).
        _, ids = index.search(source[None, :], 5)
        assert row in ids[0].tolist()[: 1 if kind != "pq" else 5]
        # Filed in its own cluster: the nearest centre holds it.
        _, nearest = index.quantizer.search(source[None, :], 1)
        invlists = index.invlists
        listed = faiss.rev_swig_ptr(
            invlists.get_ids(int(nearest[0, 0])), invlists.list_size(int(nearest[0, 0])))
        assert row in listed.tolist()
    for vector, question in asked:
        *_, last = staged.search(vector, 5)
        _, ids = index.search(vector[None, :], 5)
        assert set(last.ids) == set(ids[0].tolist()) and question.startswith("What do")


def test_timed_times_each_item() -> None:
    times: list[float] = []
    assert list(timed(iter([1, 2, 3]), times)) == [1, 2, 3]
    assert len(times) == 3 and all(t >= 0 for t in times)


def test_overlap_bound() -> None:
    summary = {"search_then_prefill": {
        "mean_search_ms": 100.0, "mean_prefill_ms": 200.0,
        "mean_stage_search_ms": [30.0, 25.0, 25.0, 20.0]}}
    bound = overlap_bound(summary)
    assert bound["ideal_pipelined_ms"] == 230.0 and bound["no_overlap_ms"] == 300.0
    assert bound["ideal_e2e_speedup"] == pytest.approx(300 / 230)
    summary["search_then_prefill"]["mean_prefill_ms"] = 50.0  # search-bound
    assert overlap_bound(summary)["ideal_pipelined_ms"] == 100.0
