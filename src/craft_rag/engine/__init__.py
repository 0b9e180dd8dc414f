"""Engine side of craft-rag: a vLLM engine (in-process, or a vLLM server over HTTP) that serves
CRAFT-ordered prompts.

Importing this package is cheap: vLLM, torch and transformers load only when an engine starts
or the embedded model is converted. See docs/engine.md.
"""

from craft_rag.engine.backends.server.backend import (
    ServerError,
    ServerRejected,
    ServerSettings,
    ServerUnavailable,
)
from craft_rag.engine.backends.vllm.backend import EngineSettings, EngineStartError
from craft_rag.engine.chat_format import derive_chat_format
from craft_rag.engine.condense import (
    CONDENSE_INSTRUCTION,
    DEFAULT_CONDENSE_MAX_TOKENS,
    Condensed,
    acondense,
    condense,
    condense_off_reason,
)
from craft_rag.engine.conversation_prompts import (
    DEFAULT_HISTORY_BUDGET,
    ConversationPrompts,
    HistoryBudget,
    RenderedTurn,
)
from craft_rag.engine.driver import EngineFailure, RequestCancelled
from craft_rag.engine.engine import CraftEngine, reused_chunk_count
from craft_rag.engine.kv_events import BlockHasher, KVEventSync
from craft_rag.engine.messages import ChatTurn
from craft_rag.engine.model import (
    PreparedModel,
    local_model_folder,
    prepare_default_model,
    resolve_model,
)
from craft_rag.engine.pipelining import SpeculativePrefill
from craft_rag.engine.requests import RequestHandle
from craft_rag.engine.results import (
    SAMPLING_KEYWORDS,
    EngineRequest,
    GenerationResult,
    MessagesRequest,
    RagRequest,
    ReuseReport,
    SamplingRequest,
    StreamChunk,
    TokensRequest,
)
from craft_rag.engine.routed_engine import RoutedEngine  # CraftEngine(server=[url, ...])
from craft_rag.engine.turn_layout import (
    APPEND_ONLY,
    DEFAULT_TURN_LAYOUT,
    LayoutChoice,
    TurnCostModel,
    TurnLayoutPolicy,
)
from craft_rag.kvtiers.chunk_cache_settings import ChunkCacheSettings
from craft_rag.scheduling.pipelining import IVFStagedSearch, PipelineReport
from craft_rag.validation import validate_cache_salt

__all__ = [
    "APPEND_ONLY",
    "CONDENSE_INSTRUCTION",
    "DEFAULT_CONDENSE_MAX_TOKENS",
    "DEFAULT_HISTORY_BUDGET",
    "DEFAULT_TURN_LAYOUT",
    "SAMPLING_KEYWORDS",
    "BlockHasher",
    "ChatTurn",
    "ChunkCacheSettings",
    "Condensed",
    "ConversationPrompts",
    "CraftEngine",
    "EngineFailure",
    "EngineRequest",
    "EngineSettings",
    "EngineStartError",
    "GenerationResult",
    "HistoryBudget",
    "IVFStagedSearch",
    "KVEventSync",
    "LayoutChoice",
    "MessagesRequest",
    "PipelineReport",
    "PreparedModel",
    "RagRequest",
    "RenderedTurn",
    "RequestCancelled",
    "RequestHandle",
    "ReuseReport",
    "RoutedEngine",
    "SamplingRequest",
    "ServerError",
    "ServerRejected",
    "ServerSettings",
    "ServerUnavailable",
    "SpeculativePrefill",
    "StreamChunk",
    "TokensRequest",
    "TurnCostModel",
    "TurnLayoutPolicy",
    "acondense",
    "condense",
    "condense_off_reason",
    "derive_chat_format",
    "local_model_folder",
    "prepare_default_model",
    "resolve_model",
    "reused_chunk_count",
    "validate_cache_salt",
]
