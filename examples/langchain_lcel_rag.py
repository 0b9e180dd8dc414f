"""LCEL RAG chain with CRAFT on the embedded default engine over SQuAD passages in LangChain FAISS.

    retriever (FAISS + MiniLM) -> CraftRAGPrompt -> ChatCraftVLLM (in-process vLLM, prefix cache)

The same stream of SQuAD questions runs three times on one engine, each from an empty prefix
cache: without prefix caching, with prefix caching in retriever order, and with CRAFT. It prints
per-request reuse and TTFT for CRAFT and a side-by-side summary. Passage embeddings come from
craft-rag's on-disk cache (computed once, ~1-2 minutes on 2 CPU cores).

Needs: pip install -e ".[retrieval]" -e benchmarks/craft-rag-bench langchain-community; pip
install --no-deps -e integrations/langchain-craft.
Run: python examples/langchain_lcel_rag.py [--questions N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine (ENGINE_NOTES)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from langchain_core.embeddings import Embeddings
from langchain_core.runnables import RunnablePassthrough
from langchain_craft import ChatCraftVLLM, CraftRAGPrompt

from craft_rag import CraftPlanner, PlannerConfig
from craft_rag.engine.engine import CraftEngine, EngineSettings
from craft_rag_bench.datasets import load_dataset
from craft_rag_bench.retrieval import Embedder, embed_passages


class MiniLMEmbeddings(Embeddings):
    """LangChain ``Embeddings`` over craft-rag's packaged all-MiniLM-L6-v2 (offline)."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.embedder.encode(texts).tolist()  # type: ignore[no-any-return]

    def embed_query(self, text: str) -> list[float]:
        return self.embedder.encode([text])[0].tolist()  # type: ignore[no-any-return]


def build_vector_store(embedder: Embedder) -> Any:
    from langchain_community.vectorstores import FAISS
    from langchain_community.vectorstores.utils import DistanceStrategy

    passages = load_dataset("squad").passages
    vectors = embed_passages(passages, embedder, show_progress=True)  # cached on disk
    return FAISS.from_embeddings(
        text_embeddings=[(p.content, v.tolist()) for p, v in zip(passages, vectors, strict=True)],
        embedding=MiniLMEmbeddings(embedder),
        metadatas=[{"title": p.title, "dataset": p.dataset} for p in passages],
        ids=[p.id for p in passages],  # stable ids: CRAFT's chunk keys
        distance_strategy=DistanceStrategy.MAX_INNER_PRODUCT,  # unit vectors: cosine
    )


def pick_questions(n: int) -> list[str]:
    """SQuAD questions grouped by paragraph, as real traffic clusters on popular pages: every
    third question of the first 3n, so neighbours retrieve overlapping but not equal sets."""
    questions = load_dataset("squad").questions
    return [q.question for q in questions[: 3 * n : 3]][:n]


def run(
    name: str, engine: CraftEngine, retriever: Any, questions: Sequence[str], **model_kw: Any
) -> list[dict[str, Any]]:
    engine.reset_prefix_cache()
    chain = (
        {"context": retriever, "question": RunnablePassthrough()}
        | CraftRAGPrompt()
        | ChatCraftVLLM(engine=engine, max_tokens=16, **model_kw)
    )
    reports = []
    for i, q in enumerate(questions):
        msg = chain.invoke(q)
        report = msg.response_metadata["craft"]
        reports.append(report)
        if name == "craft":
            print(
                f"  #{i:02d} cached {report['cached_tokens']:4d}/{report['prompt_tokens']:4d} "
                f"tokens, {report['reused_chunks']}/{len(report['chunk_order'])} chunks aligned, "
                f"TTFT {report['ttft_ms']:6.1f} ms | {q[:46]!r} -> {msg.text.strip()[:40]!r}"
            )
    return reports


def summary(name: str, reports: list[dict[str, Any]]) -> str:
    ttft = [r["ttft_ms"] for r in reports]
    cached = sum(r["cached_tokens"] for r in reports) / sum(r["prompt_tokens"] for r in reports)
    return (
        f"{name:<22} mean TTFT {statistics.mean(ttft):7.1f} ms  p50 {statistics.median(ttft):7.1f}"
        f" ms  cached-token fraction {cached:5.1%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=24)
    parser.add_argument("--k", type=int, default=4, help="documents per question")
    args = parser.parse_args()

    t0 = time.perf_counter()
    store = build_vector_store(Embedder())
    retriever = store.as_retriever(search_kwargs={"k": args.k})
    elapsed = time.perf_counter() - t0
    print(f"FAISS index over {store.index.ntotal} SQuAD passages in {elapsed:.1f} s")
    questions = pick_questions(args.questions)
    for q in questions[:2]:
        retriever.invoke(q)  # warm the query encoder so it does not count against TTFT

    t0 = time.perf_counter()
    engine = CraftEngine(EngineSettings())  # the embedded SmolLM2-135M-Instruct
    print(f"engine up in {time.perf_counter() - t0:.1f} s (block size {engine.block_size})")
    with engine:
        engine.set_planner(CraftPlanner(PlannerConfig(policy="retriever")))
        no_cache = run("no_cache", engine, retriever, questions, read_prefix_cache=False)
        engine.set_planner(CraftPlanner(PlannerConfig(policy="retriever")))
        prefix = run("prefix_cache", engine, retriever, questions)
        engine.set_planner(CraftPlanner(PlannerConfig(policy="tree")))
        print("CRAFT, per request:")
        craft = run("craft", engine, retriever, questions)
    print()
    print(summary("no prefix cache", no_cache))
    print(summary("prefix cache, retriever", prefix))
    print(summary("CRAFT (tree policy)", craft))
    speedup = statistics.mean(r["ttft_ms"] for r in no_cache) / statistics.mean(
        r["ttft_ms"] for r in craft
    )
    print(f"CRAFT mean-TTFT speed-up over no prefix cache: {speedup:.2f}x")


if __name__ == "__main__":
    main()
