"""LangChain integration for craft-rag: CRAFT chunk reordering and a vLLM engine (in-process, or
a vLLM server).

* :class:`CraftReorder`: LCEL step / document transformer / compressor ordering documents so
  shared chunks form shared prompt prefixes; :class:`CraftRetriever` applies it to a retriever.
* :class:`CraftRAGPrompt`: documents + question -> a prompt any chat model reads and
  :class:`ChatCraftVLLM` serves token-exactly.
* :class:`ChatCraftVLLM` / :class:`CraftVLLM`: chat model and LLM over ``CraftEngine`` with
  real streaming, usage, and the engine's reuse report in the metadata.
* :class:`CraftConversation`: append-only, deduplicated multi-turn RAG chat per session id over
  any ``BaseChatMessageHistory``, with a condense step for follow-ups.
* :func:`craft_minilm_embeddings`: the packaged MiniLM as ``HuggingFaceEmbeddings``.

The engine (vLLM) is imported only when a model first serves a request.
"""

from langchain_craft._documents import CRAFT_PLAN_EVENT, CraftDocuments
from langchain_craft.chat_models import ChatCraftVLLM
from langchain_craft.conversation import CraftConversation
from langchain_craft.embeddings import craft_minilm_embeddings
from langchain_craft.llms import CraftVLLM
from langchain_craft.prompt import CraftContext, CraftRAGPrompt, craft_context
from langchain_craft.reorder import CraftReorder
from langchain_craft.retrievers import CraftRetriever

__all__ = [
    "CRAFT_PLAN_EVENT",
    "ChatCraftVLLM",
    "CraftContext",
    "CraftConversation",
    "CraftDocuments",
    "CraftRAGPrompt",
    "CraftReorder",
    "CraftRetriever",
    "CraftVLLM",
    "craft_context",
    "craft_minilm_embeddings",
]
__version__ = "0.1.0"
