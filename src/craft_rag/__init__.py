"""craft-rag: CRAFT chunk reordering and conversation dedup for prefix-cache reuse in RAG.

The core (this package minus ``engine``) imports no LLM framework and no vLLM.
"""

from craft_rag.access_table import DEFAULT_WINDOW, ChunkAccessTable
from craft_rag.chunk import Chunk, content_key, make_chunk
from craft_rag.conversation import (
    ConversationRegistry,
    ConversationStore,
    ConversationStoreProtocol,
)
from craft_rag.embedding_model import packaged_embedding_model_dir
from craft_rag.metrics import prefix_overlap, total_overlap
from craft_rag.ordering import DEFAULT_POLICY, ORDERING_POLICIES, get_policy
from craft_rag.planner import CommitResult, CraftPlanner, Plan, PlannerConfig
from craft_rag.prefix_tree import ChunkPrefixTree, KVLocation, PrefixMatch
from craft_rag.prompt import DEFAULT_INSTRUCTIONS
from craft_rag.tokenizer import HFTokenizer, Tokenizer, check_text, encode_pieces
from craft_rag.types import BlockHash, ChunkKey, ConversationId, as_block_hash
from craft_rag.validation import validate_conversation_id

__all__ = [
    "DEFAULT_INSTRUCTIONS",
    "DEFAULT_POLICY",
    "DEFAULT_WINDOW",
    "ORDERING_POLICIES",
    "BlockHash",
    "Chunk",
    "ChunkAccessTable",
    "ChunkKey",
    "ChunkPrefixTree",
    "CommitResult",
    "ConversationId",
    "ConversationRegistry",
    "ConversationStore",
    "ConversationStoreProtocol",
    "CraftPlanner",
    "HFTokenizer",
    "KVLocation",
    "Plan",
    "PlannerConfig",
    "PrefixMatch",
    "Tokenizer",
    "as_block_hash",
    "check_text",
    "content_key",
    "encode_pieces",
    "get_policy",
    "make_chunk",
    "packaged_embedding_model_dir",
    "prefix_overlap",
    "total_overlap",
    "validate_conversation_id",
]
__version__ = "0.1.0"
