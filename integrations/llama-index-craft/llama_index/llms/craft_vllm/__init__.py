"""CRAFT's in-process vLLM engine for LlamaIndex.

``CraftVLLM`` is the LLM; ``CraftSynthesizer`` / ``craft_query_engine`` keep chunks intact and in
CRAFT order up to the engine; ``CraftChatEngine`` is append-only multi-turn RAG.
"""

from llama_index.llms.craft_vllm.base import REUSE_KEY, CraftVLLM
from llama_index.llms.craft_vllm.chat_engine import CraftChatEngine
from llama_index.llms.craft_vllm.synthesizer import (
    SKIPPED_KEY,
    CraftSynthesizer,
    craft_query_engine,
)

__all__ = [
    "REUSE_KEY",
    "SKIPPED_KEY",
    "CraftChatEngine",
    "CraftSynthesizer",
    "CraftVLLM",
    "craft_query_engine",
]
