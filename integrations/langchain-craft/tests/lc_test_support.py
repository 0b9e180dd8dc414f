"""Helpers shared by the langchain-craft unit and integration suites."""

from __future__ import annotations

from typing import Any

from langchain_craft import ChatCraftVLLM


class CraftChatModelTraits:
    """What langchain-tests' standard chat-model suites (unit and integration) need to know
    about ChatCraftVLLM; mix in before the suite's base class. Each suite adds its own
    ``chat_model_params``."""

    @property
    def chat_model_class(self) -> type[ChatCraftVLLM]:
        return ChatCraftVLLM

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        """The suite's standard parameters without ``api_key``/``timeout``/``max_retries``:
        they act on a server only, and these tests use the in-process engine, where
        ChatCraftVLLM refuses them (ValueError) rather than ignore them."""
        params: dict[str, Any] = super().standard_chat_model_params  # type: ignore[misc]
        return {k: v for k, v in params.items() if k not in ("api_key", "timeout", "max_retries")}

    @property
    def has_tool_calling(self) -> bool:
        return False  # bind_tools exists only to raise a NotImplementedError that says why

    @property
    def has_structured_output(self) -> bool:
        return False
