"""A planner's link to a shared store (``CraftPlanner(store=...)``), as a mixin of
:class:`craft_rag.planner.CraftPlanner`: pulling what other workers committed, pushing this
worker's entries, snapshots, and the ``?fallback=memory`` switch to local state.

Every method runs under the planner's lock (the caller holds it) except the public ``sync`` /
``shared_position``, which take it. Entries are applied with the planner's own ``_record``, so a
replayed commit changes the CA-Table, CP-Tree and conversation store exactly as the local
commit did on the worker that made it, except for the turn's token ids: only the committing
worker records them; others load them from the conversation's stored history
(:mod:`craft_rag.stores.histories`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence

from craft_rag.access_table import ChunkAccessTable
from craft_rag.conversation import ConversationStore
from craft_rag.plan_lease import PlanLeases
from craft_rag.plans import PlannerConfig
from craft_rag.prefix_tree import ChunkPrefixTree, KVLocation, NodeMetadata
from craft_rag.stores import StateStore, StoreUnavailable
from craft_rag.stores.base import LogRead
from craft_rag.stores.histories import SharedPosition
from craft_rag.stores.shared import (
    CommitEntry,
    EndEntry,
    Entry,
    ForgetEntry,
    ReplayClock,
    SharedState,
    decode_entry,
)
from craft_rag.types import ChunkKey, ConversationId
from craft_rag.validation import check_int, validate_conversation_id

logger = logging.getLogger(__name__)


class SharedSync:
    """The shared-store half of :class:`~craft_rag.planner.CraftPlanner` (see the module)."""

    config: PlannerConfig
    access_table: ChunkAccessTable
    prefix_tree: ChunkPrefixTree
    conversations: ConversationStore
    store_fallback: str | None
    _lock: threading.Lock
    _shared: SharedState | None
    _replay_clock: ReplayClock
    _leases: PlanLeases

    # Provided by CraftPlanner: apply one served plan to the table, tree and conversation store.
    _record: Callable[
        [
            tuple[ChunkKey, ...], tuple[ChunkKey, ...], int, ConversationId | None, int | None,
            Sequence[NodeMetadata] | None, KVLocation | None, Sequence[int] | None, bool,
        ],
        tuple[int, int, int],
    ]

    @property
    def store(self) -> StateStore | None:
        """The shared store this planner syncs with (None: local state only)."""
        return self._shared.store if self._shared is not None else None

    def shared_position(self) -> SharedPosition | None:
        """Store, namespace and last applied seq of a sharing planner (None: local state).
        The engine stores each conversation's prompt history there at this seq. O(1)."""
        with self._lock:
            shared = self._shared
            if shared is None:
                return None
            return SharedPosition(
                shared.store, shared.namespace, shared.applied, self.config.conversation_ttl_s
            )

    def sync(self) -> None:
        """Apply what other workers committed since the last sync (no-op without a store).
        One round trip."""
        with self._lock:
            self._pull()

    def _fall_back(self, shared: SharedState, error: StoreUnavailable) -> bool:
        """``?fallback=memory``: go on with local state (logged). False when not configured."""
        if shared.store.fallback is None:
            return False
        logger.warning("%s is unreachable; planner goes on with LOCAL state (fallback=memory): "
                       "%s", shared.where, error)
        self.store_fallback = str(error)
        self._shared = None
        return True

    def _pull(self) -> None:
        shared = self._shared
        if shared is None:
            return
        try:
            read = shared.pull()
        except StoreUnavailable as e:
            if not self._fall_back(shared, e):
                raise
            return
        self._apply(shared, read, own_seq=None)

    def _push(
        self, entry: Entry, not_after: int | None, tokens: Sequence[int] | None = None
    ) -> tuple[int, int, int] | None:
        """Append ``entry``, apply everything up to it (``tokens``: the turn's token ids,
        recorded with the entry's own keys); the entry's own ``_record`` result (None when the
        planner fell back to local state instead)."""
        shared = self._shared
        assert shared is not None
        try:
            read = shared.push(entry, not_after=not_after, ttl_s=self.config.conversation_ttl_s)
        except StoreUnavailable as e:
            if not self._fall_back(shared, e):
                raise
            return None
        return self._apply(shared, read, own_seq=read.head, own_tokens=tokens)

    def _apply(
        self,
        shared: SharedState,
        read: LogRead,
        own_seq: int | None,
        own_tokens: Sequence[int] | None = None,
    ) -> tuple[int, int, int] | None:
        if read.snapshot is not None:
            data = json.loads(read.snapshot.state)
            self.access_table = ChunkAccessTable.from_json(data["access_table"])
            self.prefix_tree = ChunkPrefixTree.from_json(
                data["prefix_tree"], clock=self._replay_clock
            )
            self.conversations = ConversationStore.from_json(
                data["conversations"], clock=self._replay_clock
            )
            shared.applied = read.snapshot.seq
            self._replay_clock.floor = float(data.get("clock", float("-inf")))
        own: tuple[int, int, int] | None = None
        clock = self._replay_clock
        for raw in read.entries:
            entry = decode_entry(raw, shared.where)
            clock.pin(entry.ts)
            try:
                if isinstance(entry, CommitEntry):
                    result = self._record(
                        entry.keys, entry.removed, entry.turn, entry.conversation,
                        entry.reused_chunks, entry.metadata, entry.location,
                        own_tokens if raw.seq == own_seq else None, entry.removed_in_prompt,
                    )
                elif isinstance(entry, EndEntry):
                    result = (int(self.conversations.end(entry.conversation)), 0, 0)
                else:
                    n = self.conversations.forget_oldest_turns(entry.conversation, entry.n)
                    result = (n, 0, 0)
            finally:
                clock.pinned = None
            if raw.seq == own_seq:
                own = result
            shared.applied = raw.seq
        if own_seq is not None and shared.snapshot_due(own_seq):
            shared.put_snapshot(own_seq, {
                "access_table": self.access_table.to_json(),
                "prefix_tree": self.prefix_tree.to_json(),
                "conversations": self.conversations.to_json(),
                "clock": clock.floor,
            })
        # Own entry not among those applied: a snapshot taken after it covered it (a planner
        # more than snapshot_every entries behind); its effect is in the snapshot.
        return own if own is not None else (0, 0, 0)

    # ---- conversation ends and drops: log entries with a store --------------------------------

    def end_conversation(self, conversation_id: str) -> bool:
        """Forget a conversation's sent chunks (in every worker, with a store). True if it was
        known. A plan of it still in flight stays committable (it records a first turn of the
        fresh conversation), but no longer blocks planning the conversation again. ``None``
        (no conversation) returns False; other non-string ids are a ``ValueError``."""
        checked = validate_conversation_id(conversation_id)
        if checked is None:
            return False
        conv = checked
        with self._lock:
            self._leases.forget_conversation(conv)
            self._pull()
            if self._shared is not None:
                result = self._push(EndEntry(conv, self._replay_clock.base()), None)
                if result is not None:
                    return bool(result[0])
            return self.conversations.end(conv)

    def forget_turns(self, conversation_id: str, n: int) -> int:
        """The conversation's prompt dropped its ``n`` oldest turns: chunks only they carried
        are planned as new again (dedup is only correct while the carrying turn is in the
        prompt). Returns the turns forgotten. O(chunks of the remaining turns)."""
        checked = validate_conversation_id(conversation_id)
        check_int(n, "n", minimum=0)
        if checked is None:
            return 0
        conv = checked
        with self._lock:
            self._pull()
            if self._shared is not None and n > 0:
                result = self._push(ForgetEntry(conv, n, self._replay_clock.base()), None)
                if result is not None:
                    return result[0]
            return self.conversations.forget_oldest_turns(conv, n)
