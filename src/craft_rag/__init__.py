"""craft-rag: CRAFT chunk reordering and conversation dedup for prefix-cache reuse in RAG.

The core (this package minus ``engine``) imports no LLM framework and no vLLM.
"""

from craft_rag.access_table import ChunkAccessTable
from craft_rag.chunk import Chunk, content_key, make_chunk
from craft_rag.conversation import ConversationRegistry
from craft_rag.metrics import prefix_overlap, total_overlap
from craft_rag.ordering import ORDERING_POLICIES, get_policy
from craft_rag.planner import CommitResult, CraftPlanner, Plan, PlannerConfig
from craft_rag.prefix_tree import ChunkPrefixTree, KVLocation, PrefixMatch
from craft_rag.types import BlockHash, ChunkKey, ConversationId, as_block_hash
from craft_rag.validation import validate_conversation_id

__all__ = [
    "ORDERING_POLICIES",
    "BlockHash",
    "Chunk",
    "ChunkAccessTable",
    "ChunkKey",
    "ChunkPrefixTree",
    "CommitResult",
    "ConversationId",
    "ConversationRegistry",
    "CraftPlanner",
    "KVLocation",
    "Plan",
    "PlannerConfig",
    "PrefixMatch",
    "as_block_hash",
    "content_key",
    "get_policy",
    "make_chunk",
    "prefix_overlap",
    "total_overlap",
    "validate_conversation_id",
]
__version__ = "0.1.0"
