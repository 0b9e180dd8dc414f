"""CRAFT's vLLM engine for LlamaIndex (started in-process, or a vLLM server it serves through).

``CraftVLLM`` is the LLM; ``CraftSynthesizer`` / ``craft_query_engine`` keep chunks intact and in
CRAFT order up to the engine; ``CraftChatEngine`` (``as_craft_chat_engine(index)``) is
append-only multi-turn RAG with a condense step. Any query engine's ``Response.metadata
["craft_reuse"]`` holds the engine's reuse report (``collect_reuse`` for other code).
"""

from llama_index.llms.craft_vllm.base import REUSE_KEY, CraftVLLM
from llama_index.llms.craft_vllm.chat_engine import (
    CONDENSE_METADATA_KEY,
    CraftChatEngine,
    as_craft_chat_engine,
)
from llama_index.llms.craft_vllm.reuse import (
    REUSE_METADATA_KEY,
    REUSE_REPORTS_KEY,
    ReuseCollector,
    collect_reuse,
)
from llama_index.llms.craft_vllm.synthesizer import (
    SKIPPED_KEY,
    CraftSynthesizer,
    craft_query_engine,
)

__all__ = [
    "CONDENSE_METADATA_KEY",
    "REUSE_KEY",
    "REUSE_METADATA_KEY",
    "REUSE_REPORTS_KEY",
    "SKIPPED_KEY",
    "CraftChatEngine",
    "CraftSynthesizer",
    "CraftVLLM",
    "ReuseCollector",
    "as_craft_chat_engine",
    "collect_reuse",
    "craft_query_engine",
]
