"""Moved to craft_rag.planner.feedback; alias kept for one release."""

from craft_rag.planner.feedback import KVFeedback

__all__ = ["KVFeedback"]
