"""Suite ``pipeline`` (issue 30, RAGCache §5.3): speculative retrieval pipelining vs
search-then-prefill, end-to-end time (retrieval + time to first token).

Corpus: a synthetic IVF index (``IndexIVFFlat``, inner product) of ``pipeline_vectors``
clustered unit vectors, searched with ``nprobe = nlist`` (every list: the index's most accurate
and slowest setting) so the search costs the same order as a prefill; vector ``i`` reads as
passage ``i mod n`` of shared/data's passages (SQuAD's in ``--quick``, the union corpus in the
full run), keyed ``v<i>`` (distinct chunks). Each query is a corpus vector plus noise, so its
top-k sits mostly, not always, in the nearest clusters: early stages often, not always, find
the final set. Seeded.

Systems, per request, each from an empty prefix cache (so the final prefill is the whole prompt
unless a speculation did it):

- ``search_then_prefill``: ``index.search`` with the full ``nprobe``, then the request;
- ``pipelined``: :class:`craft_rag.scheduling.pipelining.IVFStagedSearch` in
  ``pipeline_stages`` stages driving :class:`craft_rag.engine.SpeculativePrefill` (queue gate
  on, the engine otherwise idle).

End-to-end = search start to the final request's first token (the run's wall time minus the
decode after the first token). Reported per system: mean/p50 end-to-end, mean search time,
mean non-overlapped search time (RAGCache's T1; the baseline's is its whole search), and for
``pipelined``: speculations, restarts, reuse rate and wasted speculative prefill tokens; plus
how often both systems served the same prompt and the same greedy reply.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from craft_rag.chunk import Chunk
from craft_rag.types import ChunkKey
from craft_rag_bench.bench.context import BenchContext

if TYPE_CHECKING:
    from craft_rag.engine import CraftEngine, GenerationResult

SYSTEMS = ("search_then_prefill", "pipelined")


@dataclass(frozen=True, slots=True)
class Corpus:
    """The synthetic index, its vectors and the chunk each vector reads as."""

    index: Any
    vectors: Any
    passages: tuple[tuple[str, str], ...]  # (title, text) cycled over the vectors
    nlist: int

    def chunk(self, row: int, score: float) -> Chunk:
        title, text = self.passages[row % len(self.passages)]
        content = f"{title}\n{text}" if title else text
        return Chunk(key=ChunkKey(f"v{row}"), text=content, score=score)


def build_corpus(ctx: BenchContext) -> Corpus:
    """The seeded synthetic IVF index (training: k-means over a sample). Seconds to minutes
    with the size."""
    import faiss
    import numpy as np

    from craft_rag_bench.datasets import CORPUS_DATASETS, passage_corpus

    sizes = ctx.sizes
    names = ("squad",) if ctx.quick else CORPUS_DATASETS
    passages = tuple((p.title, p.text) for p in passage_corpus(names))
    rng = np.random.default_rng(ctx.seed)
    n, d, nlist = sizes.pipeline_vectors, sizes.pipeline_dim, sizes.pipeline_nlist
    centers = rng.standard_normal((nlist, d), dtype=np.float32)
    noise = rng.standard_normal((n, d), dtype=np.float32)
    vectors = centers[rng.integers(0, nlist, n)] + np.float32(0.6) * noise
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    quantizer = faiss.IndexFlatIP(d)
    index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
    sample = vectors[rng.choice(n, size=min(n, nlist * 64), replace=False)]
    index.train(sample)
    index.add(vectors)
    index.nprobe = nlist
    return Corpus(index=index, vectors=vectors, passages=passages, nlist=nlist)


def queries(ctx: BenchContext, corpus: Corpus) -> list[tuple[Any, str]]:
    """(query vector, question) pairs: a corpus vector plus noise, asking about its passage."""
    import numpy as np

    rng = np.random.default_rng(ctx.seed + 1)
    n, d = corpus.vectors.shape
    out: list[tuple[Any, str]] = []
    for row in rng.choice(n, size=ctx.sizes.pipeline_requests, replace=False):
        vector = corpus.vectors[row] + 0.25 * rng.standard_normal(d).astype("float32") / d**0.5
        vector /= np.linalg.norm(vector)
        title = corpus.passages[int(row) % len(corpus.passages)][0] or "the first document"
        out.append((vector.astype("float32"), f"What do the documents say about {title}?"))
    return out


def first_token_s(wall_s: float, result: GenerationResult) -> float:
    """Search start to the first token: the wall time less the decode after the first token."""
    return wall_s - (result.report.latency_ms - result.report.ttft_ms) / 1000.0


def run(ctx: BenchContext) -> dict[str, Any]:
    from craft_rag.engine import SamplingRequest, SpeculativePrefill
    from craft_rag.planner import CraftPlanner, PlannerConfig
    from craft_rag.scheduling.pipelining import IVFStagedSearch

    sizes = ctx.sizes
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
        rows["search_then_prefill"].append(
            {
                "e2e_s": base_e2e,
                "search_s": search_s,
                "non_overlapped_s": search_s,
                "prompt_tokens": len(base.prompt_token_ids),
                "cached_tokens": base.report.cached_tokens,
            }
        )
        # Pipelined: staged search driving speculative prefills.
        engine.reset_prefix_cache()
        t0 = time.perf_counter()
        stages = (
            [corpus.chunk(i, s) for i, s in zip(stage.ids, stage.scores, strict=True)]
            for stage in staged.search(vector, k)
        )
        out = pipelined.run(stages, question, total=staged.stages, sampling=sampling)
        e2e = first_token_s(time.perf_counter() - t0, out.result)
        report = out.report
        rows["pipelined"].append(
            {
                "e2e_s": e2e,
                "search_s": report.search_s,
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
    summary = {name: summarise(rows[name]) for name in SYSTEMS}
    base_e2e = summary["search_then_prefill"]["mean_e2e_ms"]
    pipe_e2e = summary["pipelined"]["mean_e2e_ms"]
    base_t1 = summary["search_then_prefill"]["mean_non_overlapped_search_ms"]
    pipe_t1 = summary["pipelined"]["mean_non_overlapped_search_ms"]
    prefill_ms = base_e2e - summary["search_then_prefill"]["mean_search_ms"]
    requests = sizes.pipeline_requests
    return {
        "suite": "pipeline",
        "corpus": {
            "vectors": sizes.pipeline_vectors,
            "dim": sizes.pipeline_dim,
            "nlist": corpus.nlist,
            "nprobe": corpus.nlist,
            "passages": len(corpus.passages),
            "build_s": round(build_s, 1),
        },
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


def report_lines(r: dict[str, Any]) -> list[str]:
    """The report section: one row per system, then the ratios."""
    corpus = r["corpus"]
    lines = [
        f"{r['requests']} requests, top-{r['top_k']}, {r['stages']} stages; synthetic IVF "
        f"index of {corpus['vectors']:,} x {corpus['dim']} vectors, nlist = nprobe = "
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
    return lines
