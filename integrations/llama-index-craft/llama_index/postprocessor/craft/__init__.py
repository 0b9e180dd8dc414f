"""CRAFT for LlamaIndex: reorder retrieved nodes so shared chunks land in reusable prompt prefixes.

``CraftReorderPostprocessor`` goes into any query engine's ``node_postprocessors``;
``CraftRetriever`` wraps any retriever. The engine-backed pieces (``CraftVLLM``,
``CraftSynthesizer``, ``CraftChatEngine``) live in :mod:`llama_index.llms.craft_vllm`.
"""

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
from llama_index.postprocessor.craft.handoff import PlanHandoff
from llama_index.postprocessor.craft.nodes import KEY_SOURCES, KeySource
from llama_index.postprocessor.craft.retriever import CraftRetriever

__all__ = [
    "COMMIT_MODES",
    "KEY_SOURCES",
    "CommitMode",
    "CraftCommitEvent",
    "CraftReorderEndEvent",
    "CraftReorderPostprocessor",
    "CraftReorderResult",
    "CraftReorderStartEvent",
    "CraftRetriever",
    "KeySource",
    "PlanHandoff",
]
