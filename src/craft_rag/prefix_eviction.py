"""Moved to craft_rag.tree.eviction (now the LeafQueue object); alias kept for one release."""

from craft_rag.tree.eviction import Entry, LeafQueue, pop_entry, push_entry

__all__ = ["Entry", "LeafQueue", "pop_entry", "push_entry"]
