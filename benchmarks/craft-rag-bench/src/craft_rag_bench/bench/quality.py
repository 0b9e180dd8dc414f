"""Suite ``quality`` (paper Figs. 5 and 7): does reordering or dedup change the answers?

Fig. 5: for the first N single-turn questions (first asks only), the answer under the
retriever's order, under CRAFT's order (the ``tree`` planner's order at that point of the
trace, from a replay of the trace up to it), under each peer's order (ContextPilot online at
that point of the trace, its offline batch order, LongContextReorder; issue 16) and under P
seeded random permutations, greedy,
scored against every gold answer with SQuAD exact match and token F1, and with a MiniLM
cosine similarity (all-MiniLM-L6-v2 sentence embeddings of answer and gold, best over golds).
That last score is NOT BERTScore (its RoBERTa model is not available offline); it plays the
same role, a semantic match that tolerates rewording.

Fig. 7: the first T MTRAG turns served twice on the engine with CRAFT ``tree``, with and
without conversation-scoped dedup; each turn's reply is scored against the reference answer,
and the per-turn scores are compared with a paired t-test (the paper: p = 0.47).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from craft_rag.chunk import Chunk
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.replay import ServedRequest, replay
from craft_rag.trace import TraceRequest
from craft_rag.types import ChunkKey
from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.peers import available_peers, peer_trace
from craft_rag_bench.bench.qa_metrics import exact_match, paired_t_test, token_f1
from craft_rag_bench.bench.serving import SYSTEMS, serve

if TYPE_CHECKING:
    from craft_rag.engine import GenerationResult


def gold_answers(workload: str, trace: Sequence[TraceRequest]) -> dict[str, tuple[str, ...]]:
    """Request id -> every gold answer (from the dataset when the workload is a built one;
    otherwise the trace's ``answer``)."""
    golds: dict[str, tuple[str, ...]] = {
        r.id: (r.answer,) for r in trace if r.answer is not None
    }
    if workload in ("squad", "hotpotqa", "triviaqa", "2wiki"):
        from craft_rag_bench.datasets import load_dataset

        by_id = {f"{q.dataset}:{q.id}": q.answers for q in load_dataset(workload).questions}
        for r in trace:
            answers = by_id.get(r.id.split("#", 1)[0])
            if answers:
                golds[r.id] = tuple(answers)
    return golds


def craft_orders(
    ctx: BenchContext, trace: Sequence[TraceRequest]
) -> dict[str, tuple[ChunkKey, ...]]:
    """The chunk order CRAFT ``tree`` gives each request when the trace is served in order."""
    orders: dict[str, tuple[ChunkKey, ...]] = {}

    def record(served: ServedRequest) -> None:
        orders[served.request_id] = tuple(served.prompt.chunk_keys)

    replay(trace, PlannerConfig(policy="tree"), ctx.tokenizer(),
           prompt_format=ctx.prompt_format(), on_served=record)
    return orders


class Scorer:
    """EM, F1 and MiniLM cosine of answers against golds (embeddings batched per call)."""

    def __init__(self, ctx: BenchContext) -> None:
        self._embedder = ctx.embedder()

    def score(
        self, answers: Sequence[str], golds: Sequence[Sequence[str]]
    ) -> list[dict[str, float]]:
        flat_golds = [g for gs in golds for g in gs]
        vectors = self._embedder.encode([*answers, *flat_golds])
        out: list[dict[str, float]] = []
        offset = len(answers)
        for i, (answer, gs) in enumerate(zip(answers, golds, strict=True)):
            sims = [float(vectors[i] @ vectors[offset + j]) for j in range(len(gs))]
            offset += len(gs)
            out.append({
                "em": exact_match(answer, gs),
                "f1": token_f1(answer, gs),
                "minilm_cosine": max(sims) if sims else 0.0,
            })
        return out


def _permutation_study(ctx: BenchContext, scorer: Scorer) -> dict[str, Any]:
    from craft_rag.engine import RagRequest

    sizes = ctx.sizes
    workload = ctx.workloads(["squad"])[0]
    trace = ctx.trace(workload, max(4 * sizes.quality_requests, 40))
    firsts = [r for r in trace if "#" not in r.id and r.conversation_id is None]
    picked = (firsts or [r for r in trace if r.conversation_id is None])[: sizes.quality_requests]
    golds = gold_answers(workload, trace)
    orders = craft_orders(ctx, trace)
    # Peers' orders of each request at its point of the trace (online peers see the past).
    peers = available_peers()
    peer_by_id = {peer: {r.id: r.chunks for r in peer_trace(peer, trace)} for peer in peers}
    engine = ctx.get_engine()
    engine.set_planner(CraftPlanner(PlannerConfig(policy="retriever", dedup=False)))
    rng = random.Random(ctx.seed)
    per_request: list[dict[str, Any]] = []
    for request in ctx.bar(picked, "quality/permutations"):
        by_key = {c.key: c for c in request.chunks}
        craft_order = [by_key[k] for k in orders.get(request.id, ()) if k in by_key]
        variants: list[list[Chunk]] = [
            list(request.chunks), craft_order or list(request.chunks)
        ]
        variants += [list(peer_by_id[p].get(request.id, request.chunks)) for p in peers]
        for _ in range(sizes.quality_permutations):
            perm = list(request.chunks)
            rng.shuffle(perm)
            variants.append(perm)
        results = engine.generate_batch(
            [RagRequest(v, request.query) for v in variants],
            max_tokens=sizes.quality_max_tokens,
        )
        gold = golds.get(request.id, (request.answer or "",))
        scores = scorer.score([r.text.strip() for r in results], [gold] * len(results))
        perms = scores[2 + len(peers):]
        row: dict[str, Any] = {
            "id": request.id,
            "question": request.query,
            "gold": list(gold),
            "retriever_answer": results[0].text.strip(),
            "craft_answer": results[1].text.strip(),
            "craft_order_differs": [c.key for c in variants[1]] != [c.key for c in variants[0]],
        }
        for j, peer in enumerate(peers):
            row[f"{peer}_answer"] = results[2 + j].text.strip()
        for metric in ("em", "f1", "minilm_cosine"):
            values = [s[metric] for s in perms]
            row[f"retriever_{metric}"] = scores[0][metric]
            row[f"craft_{metric}"] = scores[1][metric]
            for j, peer in enumerate(peers):
                row[f"{peer}_{metric}"] = scores[2 + j][metric]
            row[f"permutation_{metric}_mean"] = statistics.fmean(values) if values else None
            row[f"permutation_{metric}_std"] = statistics.pstdev(values) if values else None
        per_request.append(row)
    summary: dict[str, Any] = {}
    for metric in ("em", "f1", "minilm_cosine"):
        retriever = [r[f"retriever_{metric}"] for r in per_request]
        craft = [r[f"craft_{metric}"] for r in per_request]
        perm_means = [r[f"permutation_{metric}_mean"] for r in per_request
                      if r[f"permutation_{metric}_mean"] is not None]
        test = paired_t_test(craft, retriever)
        summary[metric] = {
            "retriever_mean": statistics.fmean(retriever) if retriever else None,
            "craft_mean": statistics.fmean(craft) if craft else None,
            "permutation_mean": statistics.fmean(perm_means) if perm_means else None,
            "mean_permutation_std": statistics.fmean(
                [r[f"permutation_{metric}_std"] for r in per_request]
            ) if per_request and sizes.quality_permutations else None,
            "craft_vs_retriever_p": test.p,
        }
        for peer in peers:
            values = [r[f"{peer}_{metric}"] for r in per_request]
            summary[metric][f"{peer}_mean"] = statistics.fmean(values) if values else None
            summary[metric][f"{peer}_vs_retriever_p"] = paired_t_test(values, retriever).p
            summary[metric][f"craft_vs_{peer}_p"] = paired_t_test(craft, values).p
    return {
        "workload": workload,
        "requests": len(per_request),
        "permutations": sizes.quality_permutations,
        "max_tokens": sizes.quality_max_tokens,
        "peers": list(peers),
        "summary": summary,
        "per_request": per_request,
    }


def _dedup_study(ctx: BenchContext, scorer: Scorer) -> dict[str, Any] | None:
    sizes = ctx.sizes
    workload = ctx.workloads(["mtrag"])[0]
    trace = [r for r in ctx.trace(workload, sizes.dedup_turns) if r.conversation_id]
    if not trace:
        return None
    engine = ctx.get_engine()
    arms: dict[str, list[GenerationResult]] = {}
    for name in ("craft_tree", "craft_tree_nodedup"):
        arms[name] = serve(engine, SYSTEMS[name], trace, max_tokens=sizes.dedup_max_tokens,
                           desc=f"quality/{name}", ctx=ctx)
    golds = [(r.answer or "",) for r in trace]
    scores = {name: scorer.score([g.text.strip() for g in rs], golds)
              for name, rs in arms.items()}
    tests: dict[str, Any] = {}
    for metric in ("f1", "minilm_cosine", "em"):
        a = [s[metric] for s in scores["craft_tree"]]
        b = [s[metric] for s in scores["craft_tree_nodedup"]]
        test = paired_t_test(a, b)
        tests[metric] = {
            "dedup_mean": statistics.fmean(a),
            "no_dedup_mean": statistics.fmean(b),
            "mean_difference": test.mean_difference,
            "t": test.t,
            "p": test.p,
            "implementation": test.implementation,
        }
    dedup = arms["craft_tree"]
    return {
        "workload": workload,
        "turns": len(trace),
        "max_tokens": sizes.dedup_max_tokens,
        "turns_with_removed_chunks": sum(1 for g in dedup if g.report.removed_duplicates),
        "removed_chunks": sum(len(g.report.removed_duplicates) for g in dedup),
        "prompt_tokens": {n: sum(g.report.prompt_tokens for g in rs) for n, rs in arms.items()},
        "tests": tests,
        "per_turn": [
            {"id": r.id, "dedup_f1": sd["f1"], "no_dedup_f1": sn["f1"],
             "dedup_minilm_cosine": sd["minilm_cosine"],
             "no_dedup_minilm_cosine": sn["minilm_cosine"],
             "removed": len(g.report.removed_duplicates)}
            for r, sd, sn, g in zip(trace, scores["craft_tree"], scores["craft_tree_nodedup"],
                                    dedup, strict=True)
        ],
    }


def run(ctx: BenchContext) -> dict[str, Any]:
    scorer = Scorer(ctx)
    return {
        "suite": "quality",
        "similarity_metric": "cosine of all-MiniLM-L6-v2 sentence embeddings (not BERTScore)",
        "permutations": _permutation_study(ctx, scorer),
        "dedup": _dedup_study(ctx, scorer),
    }
