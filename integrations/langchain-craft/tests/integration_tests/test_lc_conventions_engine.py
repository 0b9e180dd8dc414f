"""ChatOpenAI-style arguments on real components: ``model=<the embedded model's folder>``
starts an engine serving it, its system prompt at the head of the prompt reported in
``response_metadata["craft_prompt"]``; ``base_url=`` of a loopback fake vLLM server serves
through the server backend. One extra engine start (~15-60 s)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from langchain_craft import ChatCraftVLLM

from craft_rag import HFTokenizer
from craft_rag.engine.server_backend import _PROBE_TEXT
from craft_rag.testing import rerun_in_own_process

pytestmark = pytest.mark.engine

SYSTEM = "You answer in one short sentence."




def test_model_folder_serves_with_the_system_prompt_at_the_head(model_dir: Path) -> None:
    if rerun_in_own_process(
        __file__, "test_model_folder_serves_with_the_system_prompt_at_the_head"
    ):
        return
    chat = ChatCraftVLLM(
        model=str(model_dir),
        system_prompt=SYSTEM,
        context_window=2048,
        max_new_tokens=4,
        engine_settings={"num_gpu_blocks_override": 128, "kv_cache_memory_bytes": 256 << 20},
    )
    try:
        first = chat.invoke("Who wrote Hamlet? " * 20, documents=None)
        engine = chat.get_engine()
        assert engine.settings.model == str(model_dir) and engine.max_model_len == 2048
        sent = first.response_metadata["craft_prompt"]
        assert sent["text"].index(SYSTEM) < 40
        assert HFTokenizer(model_dir / "tokenizer.json").decode(sent["token_ids"]) == sent["text"]
        again = chat.invoke("Who wrote Hamlet? " * 20)
        assert again.response_metadata["craft"]["cached_tokens"] > 0
    finally:
        chat.close()


def test_base_url_of_a_loopback_server_uses_the_server_backend(model_dir: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests" / "server"))
    try:
        from fake_server import FakeServer, running
    finally:
        sys.path.pop(0)
    fake = FakeServer()
    tokenizer = HFTokenizer(model_dir / "tokenizer.json")
    probe = json.dumps({"tokens": tokenizer.encode(_PROBE_TEXT)}).encode()
    fake.answers["/tokenize"] = (200, probe)
    with running(fake) as url:
        chat = ChatCraftVLLM(model=str(model_dir), base_url=f"{url}/v1", max_tokens=3)
        try:
            msg = chat.invoke("Hello there")
            assert fake.bodies and fake.bodies[-1]["model"] == "fake-model"
            assert fake.bodies[-1]["prompt"] == msg.response_metadata["craft_prompt"]["token_ids"]
        finally:
            chat.close()
