"""LlamaIndex query engine with CRAFT on the embedded default engine, over SQuAD in a faiss store.

    VectorStoreIndex(FaissVectorStore, MiniLM) -> retriever -> llm.reorderer()  (CRAFT plan)
        -> CraftSynthesizer (chunks intact, CRAFT order) -> CraftVLLM (in-process vLLM)

The same stream of SQuAD questions runs three times on one engine, each from an empty prefix
cache: without prefix caching, with prefix caching in retriever order, and with CRAFT. It prints
per-request reuse and TTFT for CRAFT and a side-by-side summary. Passage embeddings come from
craft-rag's on-disk cache (computed once, ~1-2 minutes on 2 CPU cores); query embeddings from
llama-index-embeddings-huggingface over the same packaged MiniLM folder.

Needs: pip install llama-index-vector-stores-faiss llama-index-embeddings-huggingface
-e benchmarks/craft-rag-bench (data loaders, MiniLM retrieval);
pip install --no-deps -e integrations/llama-index-postprocessor-craft
-e integrations/llama-index-llms-craft-vllm -e integrations/llama-index-embeddings-craft-minilm.
Run: python examples/llamaindex_query_engine.py [--questions N] [--k K]
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

import faiss
from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.schema import TextNode
from llama_index.embeddings.huggingface import HuggingFaceEmbedding
from llama_index.llms.craft_vllm import REUSE_KEY, CraftVLLM, craft_query_engine
from llama_index.vector_stores.faiss import FaissVectorStore

from craft_rag import CraftPlanner, PlannerConfig
from craft_rag.engine.engine import CraftEngine, EngineSettings
from craft_rag.engine.results import ReuseReport
from craft_rag_bench.datasets import load_dataset
from craft_rag_bench.retrieval import Embedder, embed_passages


def build_index(dataset: str = "squad") -> VectorStoreIndex:
    """A LlamaIndex ``VectorStoreIndex`` on a ``FaissVectorStore`` (inner product over unit
    MiniLM vectors = cosine). Node ids are passage ids: CRAFT's chunk keys."""
    embedder = Embedder()
    passages = load_dataset(dataset).passages
    vectors = embed_passages(passages, embedder, show_progress=True)  # cached on disk
    nodes = [
        TextNode(id_=p.id, text=p.content, embedding=v.tolist(), metadata={"title": p.title})
        for p, v in zip(passages, vectors, strict=True)
    ]
    for node in nodes:  # the title is already the first line of the text
        node.excluded_llm_metadata_keys = ["title"]
        node.excluded_embed_metadata_keys = ["title"]
    store = FaissVectorStore(faiss_index=faiss.IndexFlatIP(vectors.shape[1]))
    return VectorStoreIndex(
        nodes,
        storage_context=StorageContext.from_defaults(vector_store=store),
        embed_model=HuggingFaceEmbedding(model_name=str(embedder.model_dir), device="cpu"),
    )


def pick_questions(n: int) -> list[str]:
    """Every third SQuAD question of the first 3n: neighbours ask about the same paragraphs, as
    real traffic clusters on popular pages, so retrievals overlap without being equal."""
    questions = load_dataset("squad").questions
    return [q.question for q in questions[: 3 * n : 3]][:n]


def run(
    name: str,
    engine: CraftEngine,
    index: VectorStoreIndex,
    questions: Sequence[str],
    k: int,
    policy: str,
    **llm_kw: Any,
) -> list[ReuseReport]:
    engine.reset_prefix_cache()
    engine.set_planner(CraftPlanner(PlannerConfig(policy=policy)))  # each system starts cold
    llm = CraftVLLM(engine, **llm_kw)
    query_engine = craft_query_engine(index.as_retriever(similarity_top_k=k), llm, max_tokens=16)
    reports = []
    for i, q in enumerate(questions):
        response = query_engine.query(q)
        report: ReuseReport = response.metadata[REUSE_KEY]
        reports.append(report)
        if name == "craft":
            print(
                f"  #{i:02d} cached {report.cached_tokens:4d}/{report.prompt_tokens:4d} tokens, "
                f"{report.reused_chunks}/{len(report.chunk_order)} chunks aligned, "
                f"TTFT {report.ttft_ms:6.1f} ms | {q[:44]!r} -> {str(response).strip()[:36]!r}"
            )
    return reports


def summary(name: str, reports: list[ReuseReport]) -> str:
    ttft = [r.ttft_ms for r in reports]
    cached = sum(r.cached_tokens for r in reports) / sum(r.prompt_tokens for r in reports)
    return (
        f"{name:<24} mean TTFT {statistics.mean(ttft):7.1f} ms  p50 "
        f"{statistics.median(ttft):7.1f} ms  cached-token fraction {cached:5.1%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--questions", type=int, default=24)
    parser.add_argument("--k", type=int, default=4, help="passages per question")
    args = parser.parse_args()

    t0 = time.perf_counter()
    index = build_index()
    print(f"faiss VectorStoreIndex over SQuAD built in {time.perf_counter() - t0:.1f} s")
    questions = pick_questions(args.questions)
    index.as_retriever().retrieve(questions[0])  # warm the query encoder (not counted as TTFT)

    t0 = time.perf_counter()
    engine = CraftEngine(EngineSettings())  # the embedded SmolLM2-135M-Instruct
    print(f"engine up in {time.perf_counter() - t0:.1f} s (block size {engine.block_size})")
    with engine:
        no_cache = run(
            "no_cache", engine, index, questions, args.k, "retriever", read_prefix_cache=False
        )
        prefix = run("prefix_cache", engine, index, questions, args.k, "retriever")
        print("CRAFT, per request:")
        craft = run("craft", engine, index, questions, args.k, "tree")
    print()
    print(summary("no prefix cache", no_cache))
    print(summary("prefix cache, retriever", prefix))
    print(summary("CRAFT (tree policy)", craft))
    base = statistics.mean(r.ttft_ms for r in no_cache)
    print(
        f"mean-TTFT speed-up over no prefix cache: prefix cache "
        f"{base / statistics.mean(r.ttft_ms for r in prefix):.2f}x, CRAFT "
        f"{base / statistics.mean(r.ttft_ms for r in craft):.2f}x"
    )


if __name__ == "__main__":
    main()
