"""How a served plan changes the planner's state, as a mixin of
:class:`craft_rag.planner.CraftPlanner`: the CA-Table, the CP-Tree (reuse, stale nodes,
promotion, insert) and the conversation store.

Two entries, one effect: :meth:`StateRecorder._record` applies an entry of a shared store's
log (it may come from another process: the table's ``record`` and the tree's ``insert`` check
it again); :meth:`StateRecorder._record_local` applies this planner's own commit, whose
arguments ``commit`` checked once and whose keys came from checked Chunks, through the table's
``_add`` and the tree's ``_extend`` with no second pass (commit runs on every request;
``tests/test_planner_fast_path.py`` holds the two to the same state). Caller holds the lock.
"""

from __future__ import annotations

from collections.abc import Sequence

from craft_rag.access_table import ChunkAccessTable
from craft_rag.conversation import ConversationStore
from craft_rag.plans import Hashes, PlannerConfig, Spans
from craft_rag.prefix_tree import ChunkPrefixTree, KVLocation, NodeMetadata, PrefixNode
from craft_rag.promotion import PromotionInput, PromotionRule, ServedPromotion
from craft_rag.types import ChunkKey, ConversationId

_LOCAL = KVLocation()  # where a commit's KV lives when it names no location (frozen: shared)


class StateRecorder:
    """The state-changing half of :class:`~craft_rag.planner.CraftPlanner` (see the module)."""

    config: PlannerConfig
    access_table: ChunkAccessTable
    prefix_tree: ChunkPrefixTree
    conversations: ConversationStore
    _promotion: PromotionRule

    def _record(
        self,
        keys: tuple[ChunkKey, ...],
        removed: tuple[ChunkKey, ...],
        turn: int,
        conversation_id: ConversationId | None,
        reused_chunks: int | None,
        metadata: Sequence[NodeMetadata] | None,
        location: KVLocation | None,
        tokens: Sequence[int] | None = None,
        removed_in_prompt: bool = False,
    ) -> tuple[int, int, int]:
        """Apply one served plan to the table, tree and conversation store (the replay of a
        shared log entry, own entries included): ``(reused, inserted, stale)``.
        ``removed_in_prompt``: the turn's prompt carried ``removed`` too (after ``keys``), so
        the conversation records both. Caller holds the lock."""
        self.access_table.record([*keys, *removed])
        reused = inserted = stale = 0
        if turn == 1:
            reused, stale, depth = self._reuse_and_promote(keys, reused_chunks)
            if depth > 0:  # an entry replayed from a store: checked again by insert()
                self.prefix_tree.insert(
                    keys[:depth],
                    metadata=metadata[:depth] if metadata is not None else None,
                    location=location or _LOCAL,
                )
                inserted = depth
        if conversation_id is not None:
            sent = keys + removed if removed_in_prompt else keys
            self.conversations.record_turn(conversation_id, sent, tokens)
        return reused, inserted, stale

    def _record_local(
        self,
        keys: tuple[ChunkKey, ...],
        removed: tuple[ChunkKey, ...],
        turn: int,
        conversation_id: ConversationId | None,
        reused_chunks: int | None,
        spans: Spans | None,
        hashes: Hashes | None,
        location: KVLocation | None,
        tokens: Sequence[int] | None,
        removed_in_prompt: bool = False,
        nodes: list[PrefixNode] | None = None,
    ) -> tuple[int, int, int]:
        """:meth:`_record` for this planner's own commit, whose arguments :meth:`commit`
        checked once (:func:`craft_rag.plans.commit_spans`) and whose keys came from checked
        Chunks: no second validation pass in the table or tree (it runs on every request). Same
        effect.
        ``nodes``: the tree's match of ``keys`` when the caller knows it is current (the
        plan's, tree unchanged since: :meth:`craft_rag.plan_lease.PlanLease.match`)."""
        self.access_table._add(keys + removed if removed else keys)
        reused = inserted = stale = 0
        if turn == 1:
            tree = self.prefix_tree
            if nodes is None:
                nodes = tree._matched(keys)
            if type(self._promotion) is ServedPromotion and keys:
                # _reuse_and_promote inline for the tree policy's rule (the whole served
                # order), its touch done by _extend in the same pass: one walk of the path, not two
                reused = len(nodes)
                if reused_chunks is not None and reused_chunks < reused:
                    stale = tree.remove(nodes[reused_chunks])
                    del nodes[reused_chunks:]
                    reused = reused_chunks
                tree._extend(keys, None, hashes, location or _LOCAL, nodes, True, spans)
                inserted = len(keys)
            else:
                reused, stale, depth = self._reuse_and_promote(keys, reused_chunks, nodes)
                if depth > 0:
                    whole = depth == len(keys)
                    tree._extend(
                        keys if whole else keys[:depth],
                        None,
                        hashes if whole or hashes is None else hashes[:depth],
                        location or _LOCAL,
                        nodes if len(nodes) <= depth else nodes[:depth],  # walked: not again
                        run=spans if whole or spans is None else (spans[0], spans[1][:depth]),
                    )
                    inserted = depth
        if conversation_id is not None:
            sent = keys + removed if removed_in_prompt else keys
            self.conversations.record_turn(conversation_id, sent, tokens)
        return reused, inserted, stale

    def _reuse_and_promote(
        self,
        keys: tuple[ChunkKey, ...],
        reused_chunks: int | None,
        nodes: list[PrefixNode] | None = None,
    ) -> tuple[int, int, int]:
        """A first turn's CP-Tree bookkeeping before its insert: the cached prefix it reused
        (cut to what the engine actually had: the nodes past that are stale and removed), its
        hits recorded, and the promotion rule's depth. ``(reused, stale, depth)``. ``nodes``:
        the tree's match of ``keys`` if the caller has it (cut here to the reused prefix)."""
        tree = self.prefix_tree
        if nodes is None:
            nodes = tree._matched(keys)
        reused = len(nodes)
        stale = 0
        if reused_chunks is not None and reused_chunks < reused:
            # The engine no longer had that KV: the tree's nodes past it are stale.
            stale = tree.remove(nodes[reused_chunks])
            del nodes[reused_chunks:]
            reused = reused_chunks
        tree._touch(nodes)
        rule = self._promotion
        if type(rule) is ServedPromotion:  # the whole served order; no input object to build
            return reused, stale, len(keys)
        depth = rule.promote(PromotionInput(keys, reused, self.access_table, self.config.threshold))
        return reused, stale, depth

