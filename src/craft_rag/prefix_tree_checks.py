"""Moved to craft_rag.tree.checks; alias kept for one release."""

from craft_rag.tree.checks import check_spans_contiguous, check_tree, walk

__all__ = ["check_spans_contiguous", "check_tree", "walk"]
