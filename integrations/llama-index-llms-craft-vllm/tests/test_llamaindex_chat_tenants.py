"""CraftChatEngine conversations are scoped by tenant (cache_salt): two chat engines with the
same conversation id under two salts are two conversations, and ``reset()`` of one leaves the
other's. Real CraftEngine (planners, renderer, stores) over a fake forward pass."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.llms.craft_vllm import CraftChatEngine, CraftVLLM

from craft_rag.engine.engine import CraftEngine
from craft_rag.testing import make_fake_engine


class FixedRetriever(BaseRetriever):
    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [
            NodeWithScore(node=TextNode(id_=f"n{i}", text=f"passage {i} " * 20), score=1.0)
            for i in range(2)
        ]


@pytest.fixture
def engine() -> Iterator[CraftEngine]:
    engine, _ = make_fake_engine()
    yield engine
    engine.close()


def test_reset_ends_only_its_own_tenants_conversation(engine: CraftEngine) -> None:
    llm = CraftVLLM(engine, max_tokens=2)
    chats = {
        salt: CraftChatEngine(
            FixedRetriever(), llm, conversation_id="support-1", cache_salt=salt, condense=False
        )
        for salt in ("tenant-a-secret", "tenant-b-secret")
    }
    a, b = chats["tenant-a-secret"], chats["tenant-b-secret"]
    a.chat("first question")
    b.chat("first question")  # B's own first turn, not an error about A's
    assert b.last_reuse_report is not None and b.last_reuse_report.turn == 1
    b.reset()
    assert engine.turn_count("support-1", cache_salt="tenant-a-secret") == 1
    a.chat("second question")
    assert a.last_reuse_report is not None and a.last_reuse_report.turn == 2
    assert a.last_reuse_report.removed_duplicates == ("n0", "n1") or set(
        a.last_reuse_report.removed_duplicates
    ) == {"n0", "n1"}
