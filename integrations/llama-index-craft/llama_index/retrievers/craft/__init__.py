"""``from llama_index.retrievers.craft import CraftRetriever``: the same class as in
:mod:`llama_index.postprocessor.craft`, where LlamaIndex users look for retrievers."""

from llama_index.postprocessor.craft.retriever import CraftRetriever

__all__ = ["CraftRetriever"]
