"""Moved to craft_rag.tree.io; alias kept for one release."""

from craft_rag.tree.io import FORMAT, tree_from_json, tree_to_json

__all__ = ["FORMAT", "tree_from_json", "tree_to_json"]
