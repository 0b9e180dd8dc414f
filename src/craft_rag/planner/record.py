"""How a served turn changes the planner's state: :class:`ServedTurn` (what was served) and
:meth:`StateRecorder._record`, the one path that applies it to the CA-Table, the CP-Tree (reuse,
stale nodes, promotion, insert) and the conversation store. ``StateRecorder`` is a base of
:class:`craft_rag.planner.CraftPlanner`.

Two sources, one effect. This planner's own commit (``ServedTurn.checked``): its arguments
``commit`` checked once (:func:`craft_rag.planner.plans.commit_spans`) and its keys came from
checked Chunks, so they go through the table's ``_add`` and the tree's ``insert_trusted`` with
no second pass (commit runs on every request). An entry of a shared store's log (it may come
from another process): the table's ``record`` and the tree's ``insert`` check it again.
``tests/test_planner_fast_path.py`` holds the two to the same state. Caller holds the lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from craft_rag.access_table import ChunkAccessTable
from craft_rag.conversation import ConversationStore
from craft_rag.planner.plans import Hashes, PlannerConfig, Spans
from craft_rag.promotion import PromotionInput, PromotionRule, ServedPromotion
from craft_rag.tree import ChunkPrefixTree, KVLocation, NodeMetadata, PrefixNode
from craft_rag.types import ChunkKey, ConversationId

_LOCAL = KVLocation()  # where a commit's KV lives when it names no location (frozen: shared)

Applied = tuple[int, int, int]
"""What recording a turn did: ``(reused, inserted, stale)`` chunks of the CP-Tree."""


@dataclass(frozen=True, slots=True)
class ServedTurn:
    """One served plan, as recorded: its ``keys`` (render order) and ``removed`` duplicates,
    ``turn`` of ``conversation_id``, the engine's ``reused_chunks`` (None: the tree's match),
    where the KV lives, the turn's token ids (``tokens``), and whether the prompt carried
    ``removed`` after ``keys`` (``removed_in_prompt``).

    Node metadata comes one of two ways: ``spans`` / ``hashes`` (``checked``: this planner's
    commit checked them and the keys) or ``metadata`` (a shared log entry: checked again when
    recorded)."""

    keys: tuple[ChunkKey, ...]
    removed: tuple[ChunkKey, ...] = ()
    turn: int = 1
    conversation_id: ConversationId | None = None
    reused_chunks: int | None = None
    location: KVLocation | None = None
    tokens: Sequence[int] | None = None
    removed_in_prompt: bool = False
    spans: Spans | None = None
    hashes: Hashes | None = None
    metadata: Sequence[NodeMetadata] | None = None
    checked: bool = False


class _TurnDraft:
    """A :class:`ServedTurn` under construction: the same slots, not frozen (plain slot stores;
    :func:`commit_turn` then makes it a ServedTurn, as :func:`craft_rag.planner.plans.made_plan`
    does for a Plan: a frozen dataclass sets each field through ``object.__setattr__``, ~3x the
    cost, once per commit)."""

    __slots__ = ServedTurn.__slots__  # set by dataclass(slots=True)


assert set(_TurnDraft.__slots__) == set(ServedTurn.__dataclass_fields__)  # every field
_new = object.__new__


def commit_turn(
    keys: tuple[ChunkKey, ...],
    removed: tuple[ChunkKey, ...],
    turn: int,
    conversation_id: ConversationId | None,
    reused_chunks: int | None,
    location: KVLocation | None,
    tokens: Sequence[int] | None,
    removed_in_prompt: bool,
    spans: Spans | None,
    hashes: Hashes | None,
) -> ServedTurn:
    """``ServedTurn(..., spans=spans, hashes=hashes, checked=True)`` for the planner's own
    commit, from values it checked. O(1)."""
    draft: Any = _new(_TurnDraft)
    draft.keys = keys
    draft.removed = removed
    draft.turn = turn
    draft.conversation_id = conversation_id
    draft.reused_chunks = reused_chunks
    draft.location = location
    draft.tokens = tokens
    draft.removed_in_prompt = removed_in_prompt
    draft.spans = spans
    draft.hashes = hashes
    draft.metadata = None
    draft.checked = True
    draft.__class__ = ServedTurn
    served: ServedTurn = draft
    return served


class StateRecorder:
    """The state-changing part of :class:`~craft_rag.planner.CraftPlanner` (see the module)."""

    config: PlannerConfig
    access_table: ChunkAccessTable
    prefix_tree: ChunkPrefixTree
    conversations: ConversationStore
    _promotion: PromotionRule

    def _record(self, served: ServedTurn, nodes: list[PrefixNode] | None = None) -> Applied:
        """Apply ``served`` to the table, tree and conversation store: ``(reused, inserted,
        stale)``. ``nodes``: the tree's match of ``served.keys`` when the caller knows it is
        current (the plan's, tree unchanged since: :meth:`craft_rag.planner.leases.PlanLease.
        match`). Caller holds the lock."""
        keys, removed, checked = served.keys, served.removed, served.checked
        if checked:
            self.access_table._add(keys + removed if removed else keys)
        else:
            self.access_table.record([*keys, *removed])
        reused = inserted = stale = 0
        if served.turn == 1:
            tree = self.prefix_tree
            location = served.location or _LOCAL
            reused_chunks = served.reused_chunks
            if nodes is None:
                nodes = tree.match_nodes(keys)
            if checked and type(self._promotion) is ServedPromotion and keys:
                # _reuse_and_promote inline for the tree policy's rule (the whole served
                # order), its touch done by the insert in the same pass: one walk, not two
                reused = len(nodes)
                if reused_chunks is not None and reused_chunks < reused:
                    stale = tree.remove(nodes[reused_chunks])
                    del nodes[reused_chunks:]
                    reused = reused_chunks
                tree.insert_trusted(keys, None, served.hashes, location, nodes, True, served.spans)
                inserted = len(keys)
            else:
                reused, stale, depth = self._reuse_and_promote(keys, reused_chunks, nodes)
                if depth > 0 and checked:
                    whole = depth == len(keys)
                    hashes, spans = served.hashes, served.spans
                    tree.insert_trusted(
                        keys if whole else keys[:depth],
                        None,
                        hashes if whole or hashes is None else hashes[:depth],
                        location,
                        nodes if len(nodes) <= depth else nodes[:depth],  # walked: not again
                        run=spans if whole or spans is None else (spans[0], spans[1][:depth]),
                    )
                    inserted = depth
                elif depth > 0:  # an entry replayed from a store: checked again by insert()
                    metadata = served.metadata
                    tree.insert(
                        keys[:depth],
                        metadata=metadata[:depth] if metadata is not None else None,
                        location=location,
                    )
                    inserted = depth
        conversation_id = served.conversation_id
        if conversation_id is not None:
            sent = keys + removed if served.removed_in_prompt else keys
            self.conversations.record_turn(conversation_id, sent, served.tokens)
        return reused, inserted, stale

    def _reuse_and_promote(
        self,
        keys: tuple[ChunkKey, ...],
        reused_chunks: int | None,
        nodes: list[PrefixNode],
    ) -> tuple[int, int, int]:
        """A first turn's CP-Tree bookkeeping before its insert: the cached prefix it reused
        (``nodes``, the tree's match of ``keys``, cut to what the engine actually had: the
        nodes past that are stale and removed), its hits recorded, and the promotion rule's
        depth. ``(reused, stale, depth)``."""
        tree = self.prefix_tree
        reused = len(nodes)
        stale = 0
        if reused_chunks is not None and reused_chunks < reused:
            # The engine no longer had that KV: the tree's nodes past it are stale.
            stale = tree.remove(nodes[reused_chunks])
            del nodes[reused_chunks:]
            reused = reused_chunks
        tree.touch_nodes(nodes)
        rule = self._promotion
        if type(rule) is ServedPromotion:  # the whole served order; no input object to build
            return reused, stale, len(keys)
        depth = rule.promote(PromotionInput(keys, reused, self.access_table, self.config.threshold))
        return reused, stale, depth
