"""langchain-tests' standard retriever suite against CraftRetriever.

The base retriever is an in-memory vector store with deterministic fake embeddings: the suite
tests the wrapper's contract (k in the constructor and in invoke, sync and async), which does
not depend on the embedding model; the real MiniLM/faiss path runs in the examples.
"""

from __future__ import annotations

from typing import Any

from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_craft import CraftRetriever
from langchain_tests.integration_tests import RetrieversIntegrationTests


def _base() -> Any:
    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    store.add_documents([Document(page_content=f"passage {i}", id=f"p{i}") for i in range(8)])
    return store.as_retriever(search_kwargs={"k": 8})


class TestCraftRetrieverStandard(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[CraftRetriever]:
        return CraftRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"retriever": _base(), "k": 4}

    @property
    def retriever_query_example(self) -> str:
        return "passage 3"
