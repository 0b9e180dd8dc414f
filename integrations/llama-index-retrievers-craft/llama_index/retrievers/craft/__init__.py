"""``from llama_index.retrievers.craft import CraftRetriever``: any LlamaIndex retriever, its
nodes in CRAFT order (the :class:`~llama_index.postprocessor.craft.CraftReorderPostprocessor`'s
plan). Distribution ``llama-index-retrievers-craft``."""

from llama_index.retrievers.craft.base import CraftRetriever

__all__ = ["CraftRetriever"]
