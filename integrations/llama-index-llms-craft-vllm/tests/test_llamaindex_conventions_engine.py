"""The familiar arguments on real components: ``model=<the embedded model's folder>`` starts
an engine serving it, with a system prompt fixed at the head of every prompt (two chat turns
share its KV); ``api_base=`` of a loopback fake vLLM server serves through the server
backend. One extra engine start (~15-60 s)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.llms.craft_vllm import REUSE_KEY, CraftChatEngine, CraftVLLM
from llama_index.llms.craft_vllm.calls import PROMPT_KEY

from craft_rag import HFTokenizer
from craft_rag.engine.server_backend import _PROBE_TEXT
from craft_rag.testing import rerun_in_own_process

pytestmark = pytest.mark.engine

SYSTEM = "You answer from the documents only, in one short sentence."
PASSAGES = [
    "The Denver Broncos won Super Bowl 50, beating the Carolina Panthers 24-10.",
    "Super Bowl 50 was played at Levi's Stadium in Santa Clara, California.",
]


class _Fixed(BaseRetriever):
    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [NodeWithScore(node=TextNode(text=t, id_=f"p{i}"), score=1.0)
                for i, t in enumerate(PASSAGES)]




def test_model_folder_serves_with_a_system_prompt_shared_across_turns(model_dir: Path) -> None:
    if rerun_in_own_process(
        __file__, "test_model_folder_serves_with_a_system_prompt_shared_across_turns"
    ):
        return
    llm = CraftVLLM(
        model=str(model_dir),
        system_prompt=SYSTEM,
        context_window=2048,
        max_new_tokens=8,
        engine_settings={"num_gpu_blocks_override": 128, "kv_cache_memory_bytes": 256 << 20},
    )
    try:
        assert llm.engine.settings.model == str(model_dir)
        assert llm.engine.max_model_len == 2048 and llm.metadata.model_name == str(model_dir)
        chat = CraftChatEngine(_Fixed(), llm, system_prompt=SYSTEM, condense=False)
        first = chat.chat("Who won Super Bowl 50?")
        stream = chat.stream_chat("Where was it played?")
        assert stream.metadata is not None and REUSE_KEY not in stream.metadata
        "".join(stream.response_gen)
        second = stream.metadata[REUSE_KEY]
        assert first.metadata[REUSE_KEY].prompt_tokens > 0
        assert second.cached_tokens > 0  # turn 2 reuses turn 1, system prompt first
        assert chat.last_reuse_report is second
        with pytest.raises(ValueError, match="differs from the LLM's engine"):
            CraftChatEngine(_Fixed(), llm, system_prompt="Another head.")
        done = llm.complete("Say hi.")
        sent = done.additional_kwargs[PROMPT_KEY]
        assert sent["text"].index(SYSTEM) < 40  # fixed at the head
        tokenizer = HFTokenizer(model_dir / "tokenizer.json")
        assert tokenizer.decode(sent["token_ids"]) == sent["text"]
    finally:
        llm.close()


def test_api_base_of_a_loopback_server_uses_the_server_backend(model_dir: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "server"))
    try:
        from fake_server import FakeServer, running
    finally:
        sys.path.pop(0)
    fake = FakeServer()
    tokenizer = HFTokenizer(model_dir / "tokenizer.json")
    probe = json.dumps({"tokens": tokenizer.encode(_PROBE_TEXT)}).encode()
    fake.answers["/tokenize"] = (200, probe)
    with running(fake) as url:
        llm: Any = CraftVLLM(model=str(model_dir), api_base=f"{url}/v1", max_tokens=3)
        try:
            response = llm.complete("Hello there")
            assert fake.bodies and fake.bodies[-1]["model"] == "fake-model"
            assert fake.bodies[-1]["prompt"] == response.additional_kwargs[PROMPT_KEY]["token_ids"]
        finally:
            llm.close()
