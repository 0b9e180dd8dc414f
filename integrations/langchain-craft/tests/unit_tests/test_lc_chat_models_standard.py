"""langchain-tests' standard unit suite for ChatCraftVLLM (no engine is started).

Skipped by the suite itself, because the model does not offer them: tool calling and
tool_choice (the embedded SmolLM2-135M has no tool-call format), structured output and JSON
mode (no constrained decoding wired through), image/audio/PDF/video input (text-only model),
serialization (the engine is a live in-process handle, so the model is not lc-serializable),
init from environment variables (nothing to read: no API key, no endpoint).
"""

from __future__ import annotations

from typing import Any

from langchain_tests.unit_tests import ChatModelUnitTests
from lc_test_support import CraftChatModelTraits


class TestChatCraftVLLMUnit(CraftChatModelTraits, ChatModelUnitTests):
    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"temperature": 0.0}
