"""A planner's link to a shared store (``CraftPlanner(store=...)``): :class:`SharedSync`, a
component the planner holds (None without a store), which pulls what other workers committed,
pushes this worker's entries, writes snapshots, and switches the planner to local state on
``?fallback=memory``.

Every method runs under the planner's lock (the caller holds it) except :meth:`SharedSync.
write_snapshot` (called after the lock is released). The component changes the planner only
through the planner's own methods (:class:`PlannerHost`): entries are applied with its
``_record``, a snapshot's state is installed with its ``_adopt_state``, a fallback is its
``_go_local``. So a replayed commit changes the CA-Table, CP-Tree and conversation store
exactly as the local commit did on the worker that made it, except for the turn's token ids:
only the committing worker records them; others load them from the conversation's stored
history (:mod:`craft_rag.stores.histories`).

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
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

from craft_rag.access_table import ChunkAccessTable
from craft_rag.conversation import ConversationStore
from craft_rag.planner.leases import PlanLease, PlanLeases
from craft_rag.planner.plans import PlannerConfig
from craft_rag.planner.record import Applied, ServedTurn
from craft_rag.stores import ConversationConflict, StoreCorrupted, StoreUnavailable
from craft_rag.stores.base import LogRead
from craft_rag.stores.shared import (
    CommitEntry,
    EndEntry,
    Entry,
    ReplayClock,
    SharedState,
    decode_entry,
    decode_snapshot,
)
from craft_rag.tree import ChunkPrefixTree, PrefixNode

logger = logging.getLogger(__name__)

_MAX_UNSETTLED = 1024
"""Commit attempts of unknown outcome remembered (a replay meeting one keeps its token ids);
past that the oldest are forgotten (their turns, if written, then lack ids here)."""


class PlannerHost(Protocol):
    """What :class:`SharedSync` reads and calls on the planner that holds it."""

    config: PlannerConfig
    access_table: ChunkAccessTable
    prefix_tree: ChunkPrefixTree
    conversations: ConversationStore

    def _record(self, served: ServedTurn, nodes: list[PrefixNode] | None = None) -> Applied:
        """Apply one served turn to the planner's state."""
        ...

    def _adopt_state(
        self, table: ChunkAccessTable, tree: ChunkPrefixTree, conversations: ConversationStore
    ) -> None:
        """Replace the planner's CA-Table, CP-Tree and conversation store."""
        ...

    def _go_local(self, reason: str) -> None:
        """Drop this component: the planner goes on with local state."""
        ...


class SharedSync:
    """One planner's link to one namespace of a shared store (see the module). Owner: the
    planner (``planner._sync``), used under its lock; ``shared.applied`` is the last seq
    applied. ``clock``: the planner's replay clock (tree and registry read the replayed
    entry's time while it is applied)."""

    def __init__(
        self, host: PlannerHost, shared: SharedState, leases: PlanLeases, clock: ReplayClock
    ) -> None:
        self.host = host
        self.shared = shared
        self.leases = leases
        self.clock = clock
        # Append token -> lease of a commit attempt whose outcome is not known (owner: lock).
        self.unsettled: dict[str, PlanLease] = {}
        # A snapshot's state copied under the lock, written by write_snapshot() after it.
        self.snapshot_due: tuple[int, dict[str, Any]] | None = None

    def fall_back(self, error: StoreUnavailable) -> bool:
        """``?fallback=memory``: the planner goes on with local state (logged). False when not
        configured (the caller raises ``error``)."""
        shared = self.shared
        if shared.store.fallback is None:
            return False
        logger.warning("%s is unreachable; planner goes on with LOCAL state (fallback=memory): "
                       "%s", shared.where, error)
        self.host._go_local(str(error))
        return True

    def pull(self) -> bool:
        """Apply what other workers committed since the last pull (one round trip). False if
        the store failed and the planner fell back to local state (this component is gone)."""
        shared = self.shared
        try:
            read = shared.pull()
        except StoreUnavailable as e:
            if not self.fall_back(e):
                raise
            return False
        self.apply(read, own_seq=None)
        return True

    def push(self, entry: Entry, not_after: int | None) -> Applied | None:
        """Append ``entry`` and apply everything up to it: the entry's own result (None when
        the planner fell back to local state instead)."""
        shared = self.shared
        try:
            read = shared.push(
                entry, not_after=not_after, ttl_s=self.host.config.conversation_ttl_s
            )
        except StoreUnavailable as e:
            if not self.fall_back(e):
                raise
            return None
        return self.apply(read, own_seq=read.head)

    def apply(
        self, read: LogRead, own_seq: int | None, own_tokens: Sequence[int] | None = None
    ) -> Applied:
        """Apply ``read`` (a snapshot, then entries) to the planner; the result of the entry
        at ``own_seq`` (``own_tokens``: its turn's token ids), (0, 0, 0) if a snapshot
        covered it."""
        host, shared = self.host, self.shared
        if read.snapshot is not None:
            # Decoded whole before anything changes: a bad snapshot is StoreCorrupted.
            state = decode_snapshot(read.snapshot, shared.where, self.clock)
            conversations = state.conversations
            conversations.replicated = True
            # A snapshot carries no token ids: keep this worker's own for the turns it holds,
            # and its turns in flight.
            conversations.carry_tokens(host.conversations)
            conversations.adopt_holds(host.conversations)
            host._adopt_state(state.access_table, state.prefix_tree, conversations)
            shared.applied = read.snapshot.seq
            self.clock.floor = state.clock
        own: Applied | None = None
        clock = self.clock
        unsettled = self.unsettled
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
                    result = host._record(ServedTurn(
                        entry.keys, entry.removed, entry.turn, entry.conversation,
                        entry.reused_chunks, entry.location, tokens, entry.removed_in_prompt,
                        metadata=entry.metadata,
                    ))
                    if mine is not None:
                        mine.written, mine.unsettled = result, None
                elif isinstance(entry, EndEntry):
                    result = (int(host.conversations.end(entry.conversation)), 0, 0)
                else:
                    n = host.conversations.forget_oldest_turns(entry.conversation, entry.n)
                    result = (n, 0, 0)
            finally:
                clock.pinned = None
            if raw.seq == own_seq:
                own = result
            shared.applied = raw.seq
        if own_seq is not None and shared.snapshot_due(own_seq):
            # Copied now (under the lock); written by write_snapshot once it is released.
            self.snapshot_due = (own_seq, {
                "access_table": host.access_table.to_json(),
                "prefix_tree": host.prefix_tree.to_json(),
                "conversations": host.conversations.to_json(snapshot=True),
                "clock": clock.floor,
            })
        # Own entry not among those applied: a snapshot taken after it covered it (a planner
        # more than snapshot_every entries behind); its effect is in the snapshot.
        return own if own is not None else (0, 0, 0)

    def write_snapshot(self) -> None:
        """Write the snapshot copied by the last commit at a snapshot seq, if any. Called
        WITHOUT the planner lock (the JSON text and the store round trip are O(state))."""
        due, self.snapshot_due = self.snapshot_due, None
        if due is not None:
            self.shared.put_snapshot(*due)

    # ---- a commit's append, settled when its outcome is unclear ------------------------------

    def commit(
        self, lease: PlanLease, entry: CommitEntry, tokens: Sequence[int] | None
    ) -> Applied | None:
        """Append ``lease``'s commit ``entry`` and apply the log through it: its result (None
        when the planner fell back to local state instead). On success the lease is finished.
        ``ConversationConflict``: finished and its conversation released (plan the turn
        again). Any other failure leaves the plan committable (see the module: settled at
        once when the store answers). Caller holds the lock."""
        shared = self.shared
        plan = lease.plan
        if lease.written is None and lease.unsettled is not None:
            self.settle(lease, None)  # an earlier attempt: written or void first
        if lease.written is not None:  # a replay met an earlier attempt's entry
            self.leases.finish(plan.plan_id)
            return lease.written
        token = f"{plan.planner_token:x}.{plan.plan_id}.{lease.attempts}"
        lease.attempts += 1
        lease.unsettled, lease.tokens = token, tokens
        self.unsettled[token] = lease
        try:
            read = shared.push(
                replace(entry, token=token), not_after=lease.seen,
                ttl_s=self.host.config.conversation_ttl_s,
            )
        except ConversationConflict:
            self.unsettled.pop(token, None)
            self.leases.finish(plan.plan_id)
            if plan.conversation_id is not None:
                self.host.conversations.release(plan.conversation_id)
            raise
        except StoreUnavailable as e:
            if shared.store.fallback is not None:
                self.unsettled.pop(token, None)
                self.fall_back(e)
                self.leases.finish(plan.plan_id)
                return None
            self.settle(lease, e)
        except Exception as e:  # any other store failure: the outcome is just as unknown
            self.settle(lease, e)
        else:
            self.apply(read, own_seq=read.head, own_tokens=tokens)
        if lease.written is None:  # covered by a snapshot taken after it (far behind)
            self.unsettled.pop(token, None)
            lease.written = (0, 0, 0)
        self.leases.finish(plan.plan_id)
        return lease.written

    def settle(self, lease: PlanLease, error: Exception | None) -> None:
        """Resolve ``lease``'s unsettled attempt: written -> the log applied through it
        (``lease.written`` set); not written -> voided, ``StoreUnavailable`` when ``error``
        (the failed attempt) is given; no answer -> ``StoreUnavailable``, still unsettled."""
        shared = self.shared
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
            while len(self.unsettled) > _MAX_UNSETTLED:  # bounded: the oldest are forgotten
                del self.unsettled[next(iter(self.unsettled))]
            msg = (
                f"{shared.where}: the commit of plan {plan_id} failed{why} and the store did "
                f"not answer whether it was written ({e}); the plan is still pending: commit it "
                "again once the store answers (it is recorded once), or abort it"
            )
            raise StoreUnavailable(msg) from (error or e)
        if read is not None:  # written: applying the log through it sets lease.written
            self.apply(read, own_seq=None)
            return
        self.unsettled.pop(token, None)
        lease.unsettled = None
        if error is not None:
            msg = (
                f"{shared.where}: the commit of plan {plan_id} failed{why} and was not written; "
                "the plan is still pending: commit it again once the store answers, or abort it"
            )
            if isinstance(error, StoreCorrupted):  # the store answered: its data is bad
                raise StoreCorrupted(msg) from error
            raise StoreUnavailable(msg) from error

    def abort_unsettled(self, lease: PlanLease) -> bool:
        """An aborted plan with an unsettled attempt: void it, or, when it was written after
        all, apply it (its turn is in the log). True when it was written. A store that does not
        answer is logged; a replay that meets the entry later keeps its token ids."""
        if lease.unsettled is None:
            return lease.written is not None
        try:
            self.settle(lease, None)
        except StoreUnavailable as e:
            logger.warning("%s", e)
            return False
        return lease.written is not None
