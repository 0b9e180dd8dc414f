"""Where a :class:`~craft_rag.engine.conversation_prompts.ConversationPrompts` finds its
conversations: one :class:`~craft_rag.conversation.ConversationStore` per cache salt.

A conversation is scoped by its tenant: it is found only in its own salt's store (the same id
under two salts is two conversations), and ending it ends it there alone. No method looks in
another salt's store, so no answer tells a tenant whether another one uses an id.

:class:`ConversationStores` is the seam (an engine's
:class:`~craft_rag.engine.planners.PlannerNamespaces` implements it: each salt's planner's
store, so dropped turns are forgotten through that planner and a shared store logs them);
:class:`LocalStores` is the standalone implementation (the renderer without a planner: its
unit tests and tools). Neither holds turn state of its own besides the stores.
"""

from __future__ import annotations

import threading
from typing import Protocol

from craft_rag.conversation import ConversationStore
from craft_rag.types import ConversationId

__all__ = ["ConversationStores", "LocalStores"]


class ConversationStores(Protocol):
    """Where the renderer finds conversation stores: one per cache salt. An engine's
    :class:`~craft_rag.engine.planners.PlannerNamespaces` is one (each salt's planner's
    store); :class:`LocalStores` is the standalone one."""

    def conversation_store(self, cache_salt: str | None) -> ConversationStore:
        """The salt's store, made on first use."""
        ...

    def conversation_stores(self) -> list[tuple[str | None, ConversationStore]]:
        """The stores held now, with their salts."""
        ...

    def held_store(self, cache_salt: str | None) -> ConversationStore | None:
        """The salt's store if one is held now (creates nothing, touches no LRU order)."""
        ...

    def forget_turns(self, cache_salt: str | None, conversation_id: str, n: int) -> int:
        """Drop the conversation's ``n`` oldest live turns (through its planner)."""
        ...

    def end_conversation(self, conversation_id: str, cache_salt: str | None = None) -> bool:
        """Forget the salt's conversation ``conversation_id`` (no other salt's)."""
        ...


class LocalStores:
    """One :class:`ConversationStore` per salt, owned here (``ConversationPrompts`` without a
    planner: its unit tests and tools). Thread-safe."""

    def __init__(self, max_conversations: int) -> None:
        self.max_conversations = max_conversations
        self._lock = threading.Lock()
        self._stores: dict[str | None, ConversationStore] = {}

    def conversation_store(self, cache_salt: str | None) -> ConversationStore:
        with self._lock:
            store = self._stores.get(cache_salt)
            if store is None:
                store = ConversationStore(self.max_conversations, None)
                self._stores[cache_salt] = store
            return store

    def conversation_stores(self) -> list[tuple[str | None, ConversationStore]]:
        with self._lock:
            return list(self._stores.items())

    def forget_turns(self, cache_salt: str | None, conversation_id: str, n: int) -> int:
        store = self.conversation_store(cache_salt)
        return store.forget_oldest_turns(ConversationId(conversation_id), n)

    def held_store(self, cache_salt: str | None) -> ConversationStore | None:
        with self._lock:
            return self._stores.get(cache_salt)

    def end_conversation(self, conversation_id: str, cache_salt: str | None = None) -> bool:
        store = self.held_store(cache_salt)
        return store is not None and store.end(ConversationId(conversation_id))
