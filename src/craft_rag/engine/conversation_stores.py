"""Where a :class:`~craft_rag.engine.conversation_prompts.ConversationPrompts` finds its
conversations outside a RAG turn (queries, side prompts, ending one): one
:class:`~craft_rag.conversation.ConversationStore` per cache salt, each salt's planner's.

A conversation is scoped by its tenant: it is found only in its own salt's store (the same id
under two salts is two conversations), and ending it ends it there alone. No method looks in
another salt's store, so no answer tells a tenant whether another one uses an id. A RAG turn
does not come here: it reads its salt's planner's store once, into a
:class:`~craft_rag.engine.turn_context.TurnContext`.

:class:`ConversationStores` is the seam; an engine's (and replay's)
:class:`~craft_rag.engine.planners.PlannerNamespaces` implements it. It holds no turn state
of its own besides the planners' stores.
"""

from __future__ import annotations

from typing import Protocol

from craft_rag.conversation import ConversationStore

__all__ = ["ConversationStores"]


class ConversationStores(Protocol):
    """Where the renderer finds conversation stores: one per cache salt (an engine's
    :class:`~craft_rag.engine.planners.PlannerNamespaces`: each salt's planner's store)."""

    def conversation_stores(self) -> list[tuple[str | None, ConversationStore]]:
        """The stores held now, with their salts."""
        ...

    def held_store(self, cache_salt: str | None) -> ConversationStore | None:
        """The salt's store if one is held now (creates nothing, touches no LRU order)."""
        ...

    def end_conversation(self, conversation_id: str, cache_salt: str | None = None) -> bool:
        """Forget the salt's conversation ``conversation_id`` (no other salt's)."""
        ...
