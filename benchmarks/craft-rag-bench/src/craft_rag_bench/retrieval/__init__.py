"""Dense retrieval for workloads: MiniLM embeddings (packaged wheel, offline), an on-disk
embedding cache, and faiss flat/IVF indexes. faiss, torch and sentence-transformers are imported
lazily, on first use, with an install hint if missing."""

from craft_rag_bench.retrieval.cache import embed_passages, shard_key
from craft_rag_bench.retrieval.embedder import Embedder, packaged_model_dir
from craft_rag_bench.retrieval.index import INDEX_KINDS, IndexInfo, build_index
from craft_rag_bench.retrieval.retriever import Retriever, check_k, check_query

__all__ = [
    "INDEX_KINDS",
    "Embedder",
    "IndexInfo",
    "Retriever",
    "build_index",
    "check_k",
    "check_query",
    "embed_passages",
    "packaged_model_dir",
    "shard_key",
]
