"""An LLM class given two real servers (``CraftVLLM(server=[url, url])``, LlamaIndex) answers
through both: the list reaches ``CraftEngine(server=[...])`` and requests are served by each
replica (round-robin routing here, so two requests use both whatever the caches hold). The
fake-server tests (test_routed_integrations.py) cover the rest of the integrations. Cost: one
engine start over the session's two servers (``two_vllm_servers``) and three 2-token requests.
"""

from __future__ import annotations

import uuid

import pytest

from craft_rag.chunk import make_chunk

pytestmark = pytest.mark.server


def test_craftvllm_with_two_urls_answers_through_both(two_vllm_servers: tuple[str, str]) -> None:
    pytest.importorskip("llama_index.core")
    from llama_index.llms.craft_vllm import CraftVLLM

    tag = uuid.uuid4().hex[:8]
    docs = [
        make_chunk(f"Passage {i} of {tag}: " + "rivers shape valleys. " * 12, id=f"{tag}-{i}")
        for i in range(4)
    ]
    llm = CraftVLLM(server=list(two_vllm_servers), routing="round_robin", max_tokens=2)
    try:
        assert llm.routed and llm.engine.replicas == tuple(two_vllm_servers)
        served = [
            llm.complete_chunks(docs[2 * i : 2 * i + 2], "Which rivers?") for i in range(2)
        ]
        reports = [r.additional_kwargs["craft_reuse"] for r in served]
        assert {r.replica for r in reports} == set(two_vllm_servers)
        assert all(r.prompt_tokens > 64 and r.output_tokens >= 1 for r in reports)
        # A plain chat goes through the routed engine too (routed by load).
        chat = llm.complete("Say hi.")
        assert chat.additional_kwargs["craft_reuse"].replica in two_vllm_servers
    finally:
        llm.close()
