"""Suite ``pipeline`` (issue 30, RAGCache §5.3): speculative retrieval pipelining vs
search-then-prefill, end-to-end time (retrieval + time to first token).

Corpus: a synthetic IVF index (inner product; ``pipeline_index``: ``flat`` =
``IndexIVFFlat``, ``sq8`` = ``IndexIVFScalarQuantizer`` 8-bit, ``pq`` = ``IndexIVFPQ`` with
``dim / 8`` bytes a vector) of ``pipeline_vectors`` clustered unit vectors of ``pipeline_dim``
dimensions, searched with ``nprobe = nlist`` (every list: the index's most accurate and slowest
setting) so the search costs the same order as a prefill; vector ``i`` reads as passage
``i mod n`` of shared/data's passages (SQuAD's in ``--quick``, the union corpus in the full
run), keyed ``v<i>`` (distinct chunks). The coarse quantizer is the generator's own cluster
centres and each vector is filed in the cluster it was drawn from (no k-means over the corpus:
a build of millions of vectors takes seconds to minutes, in batches, never holding the raw
vectors); a vector's own centre is its nearest by far, so this is the index k-means would
converge to. Each query is a corpus vector plus noise, so its top-k sits mostly, not always,
in the nearest clusters: early stages often, not always, find the final set. Seeded.

Systems, per request, each from an empty prefix cache (so the final prefill is the whole prompt
unless a speculation did it):

- ``search_then_prefill``: ``index.search`` with the full ``nprobe``, then the request;
- ``pipelined``: :class:`craft_rag.scheduling.pipelining.IVFStagedSearch` in
  ``pipeline_stages`` stages driving :class:`craft_rag.engine.SpeculativePrefill` (queue gate
  on, the engine otherwise idle).

End-to-end = search start to the final request's first token (the run's wall time minus the
decode after the first token). Reported per system: mean/p50 end-to-end, mean search time,
mean non-overlapped search time (RAGCache's T1; the baseline's is its whole search), the
search time of each stage, and for the baseline the prefill alone (its end-to-end less its
search); for ``pipelined``: speculations, restarts, reuse rate and wasted speculative prefill
tokens; plus how often both systems served the same prompt and the same greedy reply, the
machine's load average before and after, and the overlap bound: with perfect overlap the
pipelined request takes ``max(search, stage-1 search + prefill)``, where the two cannot run at
once (cores busy) ``search + prefill`` as the baseline does.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from craft_rag.chunk import Chunk
from craft_rag.types import ChunkKey
from craft_rag_bench.bench.context import BenchContext

if TYPE_CHECKING:
    from craft_rag.engine import CraftEngine, GenerationResult

SYSTEMS = ("search_then_prefill", "pipelined")

T = TypeVar("T")


INDEX_TYPES: dict[str, Callable[[Any, int, int], Any]] = {
    "flat": lambda q, d, nlist: _faiss().IndexIVFFlat(q, d, nlist, _faiss().METRIC_INNER_PRODUCT),
    "sq8": lambda q, d, nlist: _faiss().IndexIVFScalarQuantizer(
        q, d, nlist, _faiss().ScalarQuantizer.QT_8bit, _faiss().METRIC_INNER_PRODUCT
    ),
    "pq": lambda q, d, nlist: _faiss().IndexIVFPQ(
        q, d, nlist, d // 8, 8, _faiss().METRIC_INNER_PRODUCT
    ),
}
"""``pipeline_index`` name -> IVF index over (coarse quantizer, dim, nlist). Bytes a vector:
``flat`` 4 x dim, ``sq8`` dim, ``pq`` dim / 8 (plus 8 for its id)."""

BATCH = 65_536
"""Vectors generated and added at a time (the raw vectors are never held whole)."""


def _faiss() -> Any:
    import faiss  # lazy: only this suite needs faiss

    return faiss


def check_index_type(name: str, dim: int) -> str:
    """``name`` if it is a known ``pipeline_index`` usable at ``dim``, else ``ValueError``."""
    if name not in INDEX_TYPES:
        msg = f"pipeline index must be one of {', '.join(INDEX_TYPES)}, got {name!r}"
        raise ValueError(msg)
    if name == "pq" and dim % 8:
        msg = f"the pq index needs a dimension divisible by 8 (8 per sub-quantizer), got {dim}"
        raise ValueError(msg)
    return name


@dataclass(frozen=True, slots=True)
class Corpus:
    """The synthetic index, the query rows' own vectors and the chunk each vector reads as."""

    index: Any
    vectors: int
    dim: int
    sources: dict[int, Any]  # query row -> its vector (rows in the order queries are asked)
    passages: tuple[tuple[str, str], ...]  # (title, text) cycled over the vectors
    nlist: int

    def chunk(self, row: int, score: float) -> Chunk:
        title, text = self.passages[row % len(self.passages)]
        content = f"{title}\n{text}" if title else text
        return Chunk(key=ChunkKey(f"v{row}"), text=content, score=score)


def build_corpus(ctx: BenchContext) -> Corpus:
    """The seeded synthetic IVF index: cluster centres as the coarse quantizer, then the
    vectors in batches of :data:`BATCH`, each filed in its own cluster (``add_preassigned``);
    the index's own training (SQ ranges, PQ codebooks) on the first batch. Memory: the index
    (see :data:`INDEX_TYPES`) plus one batch. Seconds to minutes with the size."""
    import numpy as np
    from faiss.contrib import ivf_tools

    from craft_rag_bench.datasets import CORPUS_DATASETS, passage_corpus

    tools: Any = ivf_tools  # untyped
    sizes = ctx.sizes
    n, d, nlist = sizes.pipeline_vectors, sizes.pipeline_dim, sizes.pipeline_nlist
    kind = check_index_type(sizes.pipeline_index, d)
    names = ("squad",) if ctx.quick else CORPUS_DATASETS
    passages = tuple((p.title, p.text) for p in passage_corpus(names))
    rng = np.random.default_rng(ctx.seed)
    centers = rng.standard_normal((nlist, d), dtype=np.float32)
    quantizer = _faiss().IndexFlatIP(d)
    quantizer.add(centers / np.linalg.norm(centers, axis=1, keepdims=True))
    index = INDEX_TYPES[kind](quantizer, d, nlist)
    rows = np.random.default_rng(ctx.seed + 1).choice(
        n, size=min(sizes.pipeline_requests, n), replace=False
    )
    wanted = np.sort(rows)
    sources: dict[int, Any] = {}
    for start in range(0, n, BATCH):
        size = min(BATCH, n - start)
        labels = rng.integers(0, nlist, size)
        batch = centers[labels] + np.float32(0.6) * rng.standard_normal((size, d), np.float32)
        batch /= np.linalg.norm(batch, axis=1, keepdims=True)
        if not index.is_trained:  # the quantizer is set: this trains only SQ/PQ
            index.train(batch[: max(nlist * 64, 256 * 40)])
        tools.add_preassigned(index, batch, labels)
        lo, hi = np.searchsorted(wanted, [start, start + size])
        for row in wanted[lo:hi].tolist():
            sources[row] = batch[row - start].copy()
    index.nprobe = nlist
    ordered = {int(row): sources[int(row)] for row in rows}
    return Corpus(
        index=index, vectors=n, dim=d, sources=ordered, passages=passages, nlist=nlist
    )


def queries(ctx: BenchContext, corpus: Corpus) -> list[tuple[Any, str]]:
    """(query vector, question) pairs: a corpus vector plus noise, asking about its passage."""
    import numpy as np

    rng = np.random.default_rng(ctx.seed + 2)
    d = corpus.dim
    out: list[tuple[Any, str]] = []
    for row, source in corpus.sources.items():
        vector = source + 0.25 * rng.standard_normal(d).astype("float32") / d**0.5
        vector /= np.linalg.norm(vector)
        title = corpus.passages[row % len(corpus.passages)][0] or "the first document"
        out.append((vector.astype("float32"), f"What do the documents say about {title}?"))
    return out


def first_token_s(wall_s: float, result: GenerationResult) -> float:
    """Search start to the first token: the wall time less the decode after the first token."""
    return wall_s - (result.report.latency_ms - result.report.ttft_ms) / 1000.0


def timed(items: Iterable[T], times: list[float]) -> Iterator[T]:
    """``items``, appending to ``times`` the seconds each item took to produce (a lazy staged
    search: each stage's own search)."""
    iterator = iter(items)
    while True:
        before = time.perf_counter()
        item = next(iterator, None)
        if item is None:
            return
        times.append(time.perf_counter() - before)
        yield item


def run(ctx: BenchContext) -> dict[str, Any]:
    from craft_rag.engine import SamplingRequest, SpeculativePrefill
    from craft_rag.planner import CraftPlanner, PlannerConfig
    from craft_rag.scheduling.pipelining import IVFStagedSearch

    sizes = ctx.sizes
    load_before = os.getloadavg()
    started = time.perf_counter()
    corpus = build_corpus(ctx)
    build_s = time.perf_counter() - started
    engine: CraftEngine = ctx.get_engine()
    engine.set_planner(CraftPlanner(PlannerConfig(policy="tree")))
    sampling = SamplingRequest(max_tokens=sizes.ttft_max_tokens)
    staged = IVFStagedSearch(corpus.index, stages=sizes.pipeline_stages)
    pipelined = SpeculativePrefill(engine)
    k = sizes.pipeline_top_k
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in SYSTEMS}
    same_prompt = same_reply = 0
    for vector, question in ctx.bar(queries(ctx, corpus), "pipeline"):
        # Baseline: the whole search, then the request.
        engine.reset_prefix_cache()
        t0 = time.perf_counter()
        scores, ids = corpus.index.search(vector[None, :], k)
        search_s = time.perf_counter() - t0
        hits = zip(scores[0].tolist(), ids[0].tolist(), strict=True)
        chunks = [corpus.chunk(i, s) for s, i in hits if i >= 0]
        base = engine.generate(chunks, question, sampling=sampling)
        base_e2e = first_token_s(time.perf_counter() - t0, base)
        # The staged search alone (engine idle), outside any timed request: each stage's cost.
        alone: list[float] = []
        for _ in timed(staged.search(vector, k), alone):
            pass
        rows["search_then_prefill"].append(
            {
                "e2e_s": base_e2e,
                "search_s": search_s,
                "prefill_s": base_e2e - search_s,
                "stage_search_s": alone,
                "non_overlapped_s": search_s,
                "prompt_tokens": len(base.prompt_token_ids),
                "cached_tokens": base.report.cached_tokens,
            }
        )
        # Pipelined: staged search driving speculative prefills.
        engine.reset_prefix_cache()
        t0 = time.perf_counter()
        during: list[float] = []
        stages = (
            [corpus.chunk(i, s) for i, s in zip(stage.ids, stage.scores, strict=True)]
            for stage in timed(staged.search(vector, k), during)
        )
        out = pipelined.run(stages, question, total=staged.stages, sampling=sampling)
        e2e = first_token_s(time.perf_counter() - t0, out.result)
        report = out.report
        rows["pipelined"].append(
            {
                "e2e_s": e2e,
                "search_s": report.search_s,
                "stage_search_s": during,
                "non_overlapped_s": report.non_overlapped_search_s,
                "prompt_tokens": len(out.result.prompt_token_ids),
                "cached_tokens": out.result.report.cached_tokens,
                "speculate_s": report.speculate_s,
                "speculations": report.speculations,
                "restarts": report.restarts,
                "gated": report.gated,
                "reused": report.reused,
                "wasted_tokens": report.wasted_tokens,
            }
        )
        same_prompt += out.result.prompt_token_ids == base.prompt_token_ids
        same_reply += out.result.token_ids == base.token_ids
    engine.reset_prefix_cache()
    load_after = os.getloadavg()
    summary = {name: summarise(rows[name]) for name in SYSTEMS}
    base_e2e = summary["search_then_prefill"]["mean_e2e_ms"]
    pipe_e2e = summary["pipelined"]["mean_e2e_ms"]
    base_t1 = summary["search_then_prefill"]["mean_non_overlapped_search_ms"]
    pipe_t1 = summary["pipelined"]["mean_non_overlapped_search_ms"]
    prefill_ms = base_e2e - summary["search_then_prefill"]["mean_search_ms"]
    requests = len(rows["pipelined"])
    return {
        "suite": "pipeline",
        "corpus": {
            "vectors": corpus.vectors,
            "dim": corpus.dim,
            "index": sizes.pipeline_index,
            "index_type": type(corpus.index).__name__,
            "bytes_per_vector": int(corpus.index.code_size),
            "nlist": corpus.nlist,
            "nprobe": corpus.nlist,
            "passages": len(corpus.passages),
            "build_s": round(build_s, 1),
        },
        "load_before": list(load_before),
        "load_after": list(load_after),
        "requests": requests,
        "top_k": k,
        "stages": staged.stages,
        "max_tokens": sizes.ttft_max_tokens,
        "systems": summary,
        "e2e_speedup": base_e2e / pipe_e2e if pipe_e2e > 0 else None,
        "non_overlapped_search_reduction": base_t1 / pipe_t1 if pipe_t1 > 0 else None,
        "search_to_prefill": (
            summary["search_then_prefill"]["mean_search_ms"] / prefill_ms
            if prefill_ms > 0
            else None
        ),
        "overlap_bound": overlap_bound(summary),
        "same_prompt_fraction": same_prompt / requests,
        "same_reply_fraction": same_reply / requests,
        "rows": rows,
    }


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means and medians (ms) of one system's requests, plus the speculation counts."""

    def ms(key: str) -> list[float]:
        return [r[key] * 1000.0 for r in rows]

    out: dict[str, Any] = {
        "mean_e2e_ms": statistics.fmean(ms("e2e_s")),
        "p50_e2e_ms": statistics.median(ms("e2e_s")),
        "mean_search_ms": statistics.fmean(ms("search_s")),
        "mean_non_overlapped_search_ms": statistics.fmean(ms("non_overlapped_s")),
        "mean_prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in rows),
    }
    if rows and "prefill_s" in rows[0]:
        out["mean_prefill_ms"] = statistics.fmean(ms("prefill_s"))
    if rows and "stage_search_s" in rows[0]:
        out["mean_stage_search_ms"] = [
            statistics.fmean(stage) * 1000.0
            for stage in zip(*(r["stage_search_s"] for r in rows), strict=True)
        ]
    if rows and "speculations" in rows[0]:
        out |= {
            "speculations": sum(r["speculations"] for r in rows),
            "restarts": sum(r["restarts"] for r in rows),
            "gated": sum(r["gated"] for r in rows),
            "reused_fraction": sum(r["reused"] for r in rows) / len(rows),
            "wasted_tokens": sum(r["wasted_tokens"] for r in rows),
            "wasted_tokens_per_request": statistics.fmean(r["wasted_tokens"] for r in rows),
        }
    return out


def overlap_bound(summary: dict[str, Any]) -> dict[str, Any]:
    """What overlap can gain at best, from the baseline's own times (ms): the search ``s``, its
    first stage ``s1`` (alone, engine idle) and the prefill ``p``. Perfect overlap of a kept
    first-stage speculation: ``max(s, s1 + p)``; no overlap (one core for both): ``s + p``."""
    base = summary["search_then_prefill"]
    search, prefill = base["mean_search_ms"], base["mean_prefill_ms"]
    stages = base.get("mean_stage_search_ms") or [search]
    ideal = max(search, stages[0] + prefill)
    return {
        "search_ms": search,
        "first_stage_ms": stages[0],
        "prefill_ms": prefill,
        "ideal_pipelined_ms": ideal,
        "no_overlap_ms": search + prefill,
        "ideal_e2e_speedup": (search + prefill) / ideal if ideal > 0 else None,
    }


def report_lines(r: dict[str, Any]) -> list[str]:
    """The report section: one row per system, then the ratios."""
    corpus = r["corpus"]
    lines = [
        f"{r['requests']} requests, top-{r['top_k']}, {r['stages']} stages; synthetic IVF "
        f"index ({corpus.get('index', 'flat')}) of {corpus['vectors']:,} x {corpus['dim']} "
        "vectors, nlist = nprobe = "
        f"{corpus['nlist']}; each request from an empty prefix cache.",
        "",
        "| system | mean e2e ms | p50 e2e ms | mean search ms | non-overlapped search ms | "
        "restarts | reused | wasted spec. tokens/request |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in r["systems"].items():
        reused = s.get("reused_fraction")
        lines.append(
            f"| {name} | {s['mean_e2e_ms']:.1f} | {s['p50_e2e_ms']:.1f} | "
            f"{s['mean_search_ms']:.1f} | {s['mean_non_overlapped_search_ms']:.1f} | "
            f"{s.get('restarts', '-')} | "
            f"{'-' if reused is None else f'{reused:.0%}'} | "
            f"{s.get('wasted_tokens_per_request', '-')} |"
        )

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    lines += [
        "",
        f"End-to-end speedup {ratio(r['e2e_speedup'])}; non-overlapped search "
        f"{ratio(r['non_overlapped_search_reduction'])} lower; search / prefill "
        f"{ratio(r['search_to_prefill'])}; same prompt {r['same_prompt_fraction']:.0%}, "
        f"same greedy reply {r['same_reply_fraction']:.0%}.",
    ]
    bound = r.get("overlap_bound")
    if bound:
        stages = r["systems"]["search_then_prefill"].get("mean_stage_search_ms", [])
        during = r["systems"]["pipelined"].get("mean_stage_search_ms", [])
        lines += [
            "",
            f"Overlap bound: search {bound['search_ms']:.1f} ms (stages alone "
            f"{', '.join(f'{x:.1f}' for x in stages)}; during the pipelined run "
            f"{', '.join(f'{x:.1f}' for x in during)}), prefill alone "
            f"{bound['prefill_ms']:.1f} ms: perfect overlap {bound['ideal_pipelined_ms']:.1f} ms "
            f"vs {bound['no_overlap_ms']:.1f} ms without ({ratio(bound['ideal_e2e_speedup'])} "
            "at best).",
        ]
    return lines
