"""CRAFT for LlamaIndex: reorder retrieved nodes so shared chunks land in reusable prompt prefixes.

``CraftReorderPostprocessor`` goes into any query engine's ``node_postprocessors``. The
retriever wrapper ``CraftRetriever`` ships in ``llama-index-retrievers-craft``
(:mod:`llama_index.retrievers.craft`; still importable from here when that distribution is
installed); the engine-backed pieces (``CraftVLLM``, ``CraftSynthesizer``, ``CraftChatEngine``)
in ``llama-index-llms-craft-vllm`` (:mod:`llama_index.llms.craft_vllm`).
"""

from typing import Any

from llama_index.postprocessor.craft.base import (
    COMMIT_MODES,
    CommitMode,
    CraftReorderPostprocessor,
    CraftReorderResult,
)
from llama_index.postprocessor.craft.events import (
    CraftCommitEvent,
    CraftReorderEndEvent,
    CraftReorderStartEvent,
)
from llama_index.postprocessor.craft.nodes import (
    KEY_SOURCES,
    KeySource,
    SplitNodes,
    chunk_for_node,
    default_key_source,
    split_nodes,
)

__all__ = [
    "COMMIT_MODES",
    "KEY_SOURCES",
    "CommitMode",
    "CraftCommitEvent",
    "CraftReorderEndEvent",
    "CraftReorderPostprocessor",
    "CraftReorderResult",
    "CraftReorderStartEvent",
    "KeySource",
    "SplitNodes",
    "chunk_for_node",
    "default_key_source",
    "split_nodes",
]


def __getattr__(name: str) -> Any:
    """``CraftRetriever`` moved to ``llama-index-retrievers-craft``; the old import path keeps
    working where that distribution is installed (it depends on this one, never the reverse)."""
    if name == "CraftRetriever":
        try:
            from llama_index.retrievers.craft import CraftRetriever
        except ImportError as exc:
            msg = "CraftRetriever ships in llama-index-retrievers-craft: pip install it"
            raise ImportError(msg) from exc
        return CraftRetriever
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
