"""langchain-tests' standard integration suite for ChatCraftVLLM on the REAL engine.

Uses the repository's shared ``craft_engine`` fixture (never a private engine) with replies
capped at 8 tokens: on the 2-core CPU machine the suite's ~25 engine requests take about half
a minute. Capabilities the suite skips, and why:

* tool calling, tool_choice, agent loop, tool-message histories: the embedded SmolLM2-135M has
  no tool-call format and the engine serves plain text;
* structured output, JSON mode: no constrained decoding is wired through the engine;
* image, audio, PDF, video inputs: text-only model;
* model override per call: one engine serves one model (a different ``model=`` is a
  ``ValueError``);
* cache-read usage details: reported (``input_token_details.cache_read``) and tested in
  ``test_lc_engine.py``; the suite's extra cache fixtures are not wired.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from lc_test_support import CraftChatModelTraits

pytestmark = pytest.mark.engine


class TestChatCraftVLLMIntegration(CraftChatModelTraits, ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _use_shared_engine(self, craft_engine: Any) -> None:
        self._engine = craft_engine

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": self._engine, "max_tokens": 8}

    @property
    def supports_model_override(self) -> bool:
        return False
