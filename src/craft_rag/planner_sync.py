"""A planner's link to a shared store (``CraftPlanner(store=...)``), as a mixin of
:class:`craft_rag.planner.CraftPlanner`: pulling what other workers committed, pushing this
worker's entries, snapshots, and the ``?fallback=memory`` switch to local state.

Every method runs under the planner's lock (the caller holds it) except the public ``sync`` /
``shared_position``, which take it. Entries are applied with the planner's own ``_record``, so a
replayed commit changes the CA-Table, CP-Tree and conversation store exactly as the local
commit did on the worker that made it, except for the turn's token ids: only the committing
worker records them; others load them from the conversation's stored history
(:mod:`craft_rag.stores.histories`).

**One state, from the log alone.** Whatever changes the shared state is a log entry; local
happenings (a turn in flight, this worker's clock, KV events aside) never move, start, refresh
or evict a conversation (:attr:`ConversationStore.replicated`), so every worker and a late
reader hold the same state after the same entries.

**A commit is recorded once, or not at all, and the caller knows which.** Each append attempt
carries a token (``CommitEntry.token``). When the append fails without a clear answer (a reply
later than the store's timeout, a dropped connection, a lock past ``busy_timeout_ms``, any
other store error) the plan is not consumed: the store is asked at once whether the entry was
written (:meth:`StateStore.settle`, which also voids the token if not, so a request still on
its way cannot land later). Written: the commit is done (the log is applied through it, the
turn's token ids kept); not written: ``StoreUnavailable`` and the plan stays committable (a
retry appends with a new token); no answer: ``StoreUnavailable``, the plan stays committable
and the next commit (or abort) of it settles first. A replay that meets the entry of an
unsettled attempt treats it as this worker's own (its token ids are kept).

**Snapshots are bounded and written outside the lock.** A snapshot holds the CA-Table, the
CP-Tree and each conversation's live chunk keys, never token ids (~12 KB per 2,000-token turn):
those stay in each worker's memory and in the store's per-conversation history records, and a
worker loading a snapshot keeps the token ids it had for the turns the snapshot holds. The
snapshot's state is copied under the lock (``to_json``, O(state), bounded by ``max_tree_nodes``
and ``max_conversations``); the JSON text and the store write happen after the lock is
released, so other requests never wait on that I/O. Measured at the defaults (10,000
two-turn conversations of 2,000 tokens a turn, 41,000 tree nodes): an 8.5 MiB snapshot (the
tree 6.4, conversations 2.0) instead of ~125 MiB with token ids; ~1 s of copying under the lock
(the tree ~90% of it) on a loaded 2-core machine, once per ``snapshot_every`` commits, and
~0.5 s of JSON after it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from craft_rag.access_table import ChunkAccessTable
from craft_rag.conversation import ConversationStore
from craft_rag.plan_lease import PlanLease, PlanLeases
from craft_rag.plans import PlannerConfig
from craft_rag.prefix_tree import ChunkPrefixTree, KVLocation, NodeMetadata
from craft_rag.stores import ConversationConflict, StateStore, StoreCorrupted, StoreUnavailable
from craft_rag.stores.base import LogRead
from craft_rag.stores.shared import (
    CommitEntry,
    EndEntry,
    Entry,
    ForgetEntry,
    ReplayClock,
    SharedPosition,
    SharedState,
    decode_entry,
    decode_snapshot,
)
from craft_rag.types import ChunkKey, ConversationId
from craft_rag.validation import check_int, validate_conversation_id

logger = logging.getLogger(__name__)

_MAX_UNSETTLED = 1024
"""Commit attempts of unknown outcome remembered (a replay meeting one keeps its token ids);
past that the oldest are forgotten (their turns, if written, then lack ids here)."""


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
    _unsettled: dict[str, PlanLease]
    """Append token -> lease of a commit attempt whose outcome is not known (owner: _lock)."""
    _snapshot_due: tuple[int, dict[str, Any]] | None
    """A snapshot's state copied under the lock, written by :meth:`_write_snapshot`."""

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
            # Decoded whole before anything changes: a bad snapshot is StoreCorrupted.
            state = decode_snapshot(read.snapshot, shared.where, self._replay_clock)
            self.access_table, self.prefix_tree = state.access_table, state.prefix_tree
            conversations = state.conversations
            conversations.replicated = True
            # A snapshot carries no token ids: keep this worker's own for the turns it holds,
            # and its turns in flight.
            conversations.carry_tokens(self.conversations)
            conversations.adopt_holds(self.conversations)
            self.conversations = conversations
            shared.applied = read.snapshot.seq
            self._replay_clock.floor = state.clock
        own: tuple[int, int, int] | None = None
        clock = self._replay_clock
        unsettled = self._unsettled
        for raw in read.entries:
            entry = decode_entry(raw, shared.where)
            clock.pin(entry.ts)
            try:
                if isinstance(entry, CommitEntry):
                    tokens = own_tokens if raw.seq == own_seq else None
                    mine = None
                    if unsettled and entry.token is not None:
                        mine = unsettled.pop(entry.token, None)
                        if mine is not None:  # this worker's attempt: its token ids
                            tokens = mine.tokens
                    result = self._record(
                        entry.keys, entry.removed, entry.turn, entry.conversation,
                        entry.reused_chunks, entry.metadata, entry.location,
                        tokens, entry.removed_in_prompt,
                    )
                    if mine is not None:
                        mine.written, mine.unsettled = result, None
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
            # Copied now (under the lock); written by _write_snapshot once it is released.
            self._snapshot_due = (own_seq, {
                "access_table": self.access_table.to_json(),
                "prefix_tree": self.prefix_tree.to_json(),
                "conversations": self.conversations.to_json(snapshot=True),
                "clock": clock.floor,
            })
        # Own entry not among those applied: a snapshot taken after it covered it (a planner
        # more than snapshot_every entries behind); its effect is in the snapshot.
        return own if own is not None else (0, 0, 0)

    def _write_snapshot(self) -> None:
        """Write the snapshot copied by the last commit at a snapshot seq, if any. Called
        WITHOUT the planner lock (the JSON text and the store round trip are O(state))."""
        due, self._snapshot_due = self._snapshot_due, None
        shared = self._shared
        if due is not None and shared is not None:
            shared.put_snapshot(*due)

    # ---- a commit's append, settled when its outcome is unclear ------------------------------

    def _commit_shared(
        self, lease: PlanLease, entry: CommitEntry, tokens: Sequence[int] | None
    ) -> tuple[int, int, int] | None:
        """Append ``lease``'s commit ``entry`` and apply the log through it: its ``_record``
        result (None when the planner fell back to local state instead). On success the lease
        is finished. ``ConversationConflict``: finished and its conversation released (plan the
        turn again). Any other failure leaves the plan committable (see the module: settled
        at once when the store answers). Caller holds the lock."""
        shared = self._shared
        assert shared is not None
        plan = lease.plan
        if lease.written is None and lease.unsettled is not None:
            self._settle(shared, lease, None)  # an earlier attempt: written or void first
        if lease.written is not None:  # a replay met an earlier attempt's entry
            self._leases.finish(plan.plan_id)
            return lease.written
        token = f"{plan.planner_token:x}.{plan.plan_id}.{lease.attempts}"
        lease.attempts += 1
        lease.unsettled, lease.tokens = token, tokens
        self._unsettled[token] = lease
        try:
            read = shared.push(
                replace(entry, token=token), not_after=lease.seen,
                ttl_s=self.config.conversation_ttl_s,
            )
        except ConversationConflict:
            self._unsettled.pop(token, None)
            self._leases.finish(plan.plan_id)
            if plan.conversation_id is not None:
                self.conversations.release(plan.conversation_id)
            raise
        except StoreUnavailable as e:
            if shared.store.fallback is not None:
                self._unsettled.pop(token, None)
                self._fall_back(shared, e)
                self._leases.finish(plan.plan_id)
                return None
            self._settle(shared, lease, e)
        except Exception as e:  # any other store failure: the outcome is just as unknown
            self._settle(shared, lease, e)
        else:
            self._apply(shared, read, own_seq=read.head, own_tokens=tokens)
        if lease.written is None:  # covered by a snapshot taken after it (far behind)
            self._unsettled.pop(token, None)
            lease.written = (0, 0, 0)
        self._leases.finish(plan.plan_id)
        return lease.written

    def _settle(self, shared: SharedState, lease: PlanLease, error: Exception | None) -> None:
        """Resolve ``lease``'s unsettled attempt: written -> the log applied through it
        (``lease.written`` set); not written -> voided, ``StoreUnavailable`` when ``error``
        (the failed attempt) is given; no answer -> ``StoreUnavailable``, still unsettled."""
        token = lease.unsettled
        assert token is not None
        plan_id = lease.plan.plan_id
        why = f" ({error})" if error is not None else ""
        try:
            try:
                seq = shared.store.settle(shared.namespace, token)
            except StoreUnavailable:  # one more try: the blip that failed the append may last
                seq = shared.store.settle(shared.namespace, token)
            read = shared.pull() if seq > 0 else None
        except Exception as e:
            while len(self._unsettled) > _MAX_UNSETTLED:  # bounded: the oldest are forgotten
                del self._unsettled[next(iter(self._unsettled))]
            msg = (
                f"{shared.where}: the commit of plan {plan_id} failed{why} and the store did "
                f"not answer whether it was written ({e}); the plan is still pending: commit it "
                "again once the store answers (it is recorded once), or abort it"
            )
            raise StoreUnavailable(msg) from (error or e)
        if read is not None:  # written: applying the log through it sets lease.written
            self._apply(shared, read, own_seq=None)
            return
        self._unsettled.pop(token, None)
        lease.unsettled = None
        if error is not None:
            msg = (
                f"{shared.where}: the commit of plan {plan_id} failed{why} and was not written; "
                "the plan is still pending: commit it again once the store answers, or abort it"
            )
            if isinstance(error, StoreCorrupted):  # the store answered: its data is bad
                raise StoreCorrupted(msg) from error
            raise StoreUnavailable(msg) from error

    def _abort_unsettled(self, lease: PlanLease) -> bool:
        """An aborted plan with an unsettled attempt: void it, or, when it was written after
        all, apply it (its turn is in the log). True when it was written. A store that does not
        answer is logged; a replay that meets the entry later keeps its token ids."""
        shared = self._shared
        if shared is None or lease.unsettled is None:
            return lease.written is not None
        try:
            self._settle(shared, lease, None)
        except StoreUnavailable as e:
            logger.warning("%s", e)
            return False
        return lease.written is not None

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
            result = None
            if self._shared is not None:
                result = self._push(EndEntry(conv, self._replay_clock.base()), None)
            ended = bool(result[0]) if result is not None else self.conversations.end(conv)
        self._write_snapshot()
        return ended

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
            result = None
            if self._shared is not None and n > 0:
                result = self._push(ForgetEntry(conv, n, self._replay_clock.base()), None)
            forgotten = (
                result[0] if result is not None else self.conversations.forget_oldest_turns(conv, n)
            )
        self._write_snapshot()
        return forgotten
