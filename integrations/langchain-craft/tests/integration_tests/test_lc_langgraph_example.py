"""examples/langgraph_chat.py at a tiny size on the real engine (run in CI): a LangGraph graph
with a checkpointer keeps CRAFT's reuse across turns."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.engine

EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "langgraph_chat.py"


def test_langgraph_example_keeps_reuse_across_turns(craft_engine: Any) -> None:
    pytest.importorskip("langgraph", reason="pip install langgraph")
    pytest.importorskip("langchain_huggingface", reason="pip install langchain-huggingface")
    spec = importlib.util.spec_from_file_location("langgraph_chat_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    try:
        reports = example.main(craft_engine, passages=20, max_tokens=4)
    except FileNotFoundError as exc:  # shared/data or the MiniLM wheel missing
        pytest.skip(str(exc))
    assert [r["turn"] for r in reports] == [1, 2, 3]
    block = craft_engine.block_size
    for before, after in itertools.pairwise(reports):
        # Each turn continues the thread's prompt: everything the previous turn sent is cached.
        assert after["cached_tokens"] >= before["prompt_tokens"] // block * block > 0
        assert after["conversation_id"] == reports[0]["conversation_id"]
