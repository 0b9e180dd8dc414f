"""Helpers shared by the langchain-craft unit and integration suites."""

from __future__ import annotations

from langchain_craft import ChatCraftVLLM


class CraftChatModelTraits:
    """What langchain-tests' standard chat-model suites (unit and integration) need to know
    about ChatCraftVLLM; mix in before the suite's base class. Each suite adds its own
    ``chat_model_params``."""

    @property
    def chat_model_class(self) -> type[ChatCraftVLLM]:
        return ChatCraftVLLM

    @property
    def has_tool_calling(self) -> bool:
        return False  # bind_tools exists only to raise a NotImplementedError that says why

    @property
    def has_structured_output(self) -> bool:
        return False
