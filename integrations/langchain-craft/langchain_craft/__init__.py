"""LangChain integration for craft-rag."""

from langchain_craft._documents import CRAFT_PLAN_EVENT, CraftDocuments
from langchain_craft.reorder import CraftReorder
from langchain_craft.retrievers import CraftRetriever

__all__ = ["CRAFT_PLAN_EVENT", "CraftDocuments", "CraftReorder", "CraftRetriever"]
