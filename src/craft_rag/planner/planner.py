"""The CRAFT planner: one entry point from retrieved chunks to the order the engine should see.

``plan()`` reads state and returns a :class:`Plan` (a lease, see :mod:`craft_rag.planner.leases`);
``commit()`` records what was actually served (CA-Table counts, CP-Tree promotion/extension
with the engine's token spans and block hashes, the conversation's frozen turn). A plan that is
never committed (engine failure) changes nothing. An engine serving a plan made elsewhere
claims it by its id (:meth:`CraftPlanner.claim`), so it is served once at a time.

Thread safety: one lock guards all planner state; ``plan`` and ``commit`` each hold it for O(k)
work (plus the tree policy's set match), so concurrent requests are serialised only for
microseconds while engine work runs outside it. State is owned here: the table, tree and
conversation store are mutated only inside ``commit`` (one path for every served turn:
:mod:`craft_rag.planner.record`), the KV-event callbacks and the shared-store component
(:mod:`craft_rag.planner.sync`, which swaps in a snapshot's state through ``_adopt_state``).
The value types live in :mod:`craft_rag.planner.plans`, the JSON codec in
:mod:`craft_rag.planner.io`.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from craft_rag.access_table import ChunkAccessTable
from craft_rag.chunk import Chunk
from craft_rag.conversation import ConversationStore
from craft_rag.ordering import OrderingContext, TreeOrder, get_policy
from craft_rag.planner.feedback import KVFeedback
from craft_rag.planner.io import PlannerFiles, read_state_file, state_from_json
from craft_rag.planner.leases import LeaseDesk, PlanLease, PlanLeases
from craft_rag.planner.plans import (
    CommitResult,
    Plan,
    PlannerConfig,
    PlannerStats,
    check_tokens,
    commit_spans,
    made_plan,
    made_result,
    node_metadata,
    split_repeats,
)
from craft_rag.planner.record import Applied, StateRecorder, commit_turn
from craft_rag.planner.sync import SharedSync
from craft_rag.promotion import get_promotion_rule
from craft_rag.stores import DEFAULT_NAMESPACE, StateStore, StoreUnavailable, as_store
from craft_rag.stores.shared import (
    CommitEntry,
    EndEntry,
    ForgetEntry,
    ReplayClock,
    SharedPosition,
    SharedState,
    config_fingerprint,
)
from craft_rag.tree import ChunkPrefixTree, KVLocation, PrefixNode
from craft_rag.types import BlockHash
from craft_rag.validation import check_int, materialise, validate_conversation_id

__all__ = ["CommitResult", "CraftPlanner", "Plan", "PlannerConfig", "PlannerStats"]

_MAX_PENDING = 65_536
_ONLY_CHUNKS = frozenset({Chunk})


class CraftPlanner(LeaseDesk, KVFeedback, StateRecorder, PlannerFiles):
    """CA-Table + CP-Tree + conversation dedup behind ``plan``/``commit``.

    One planner serves one prompt head: CP-Tree nodes are keyed by chunk keys only, while their
    token spans and block hashes depend on the tokens before the first chunk (system prompt,
    instructions) and on the engine's cache salt. Use one planner per head or tenant (the
    engine keeps one per ``cache_salt``) and pass the same ``prefix_tokens`` on every commit.

    Cost per request: O(k log k) ordering + O(k) table/tree/registry updates; the ``tree`` policy
    adds its set match (see :meth:`ChunkPrefixTree.match_subset`).

    **Shared state** (``store=``, see :mod:`craft_rag.stores`): every commit is appended to the
    namespace's commit log, and ``plan``/``commit`` first apply the entries other workers
    appended (one round trip each, under the lock), so every planner of the namespace holds the
    CA-Table, CP-Tree and conversations one planner would hold had it served all requests in
    log order. A conversation turn planned before another worker committed a turn of it is
    refused at commit (``RuntimeError``: plan it again). KV events stay local (each worker hears
    its engine). With a store the default clock is ``time.time`` (comparable across processes).
    """

    def __init__(
        self,
        config: PlannerConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        store: StateStore | str | None = None,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> None:
        if config is not None and not isinstance(config, PlannerConfig):
            msg = (
                f"config: must be a craft_rag.PlannerConfig, got {type(config).__name__}; "
                "build one with PlannerConfig(policy=..., window=...)"
            )
            raise ValueError(msg)
        if not callable(clock):
            msg = f"clock: must be a callable returning seconds, got {type(clock).__name__}"
            raise ValueError(msg)
        self.config = config or PlannerConfig()
        if store is not None and clock is time.monotonic:
            clock = time.time
        self._clock = clock
        # Shared mode: tree and registry read the replayed entry's time while applying it.
        self._replay_clock = ReplayClock(clock)
        state_clock = self._replay_clock if store is not None else clock
        self._lock = threading.Lock()
        self._policy = get_policy(self.config.policy)
        self._promotion = get_promotion_rule(self.config.promotion_rule)
        self.access_table = ChunkAccessTable(self.config.window)
        self.prefix_tree = ChunkPrefixTree(self.config.max_tree_nodes, clock=state_clock)
        self.conversations = ConversationStore(
            self.config.max_conversations, self.config.conversation_ttl_s, clock=state_clock
        )
        self._context = OrderingContext(self.access_table, self.prefix_tree)
        self.stats = PlannerStats()
        self._plan_ids = itertools.count(1)
        # Random per instance (and per load): a plan id alone would let planner B, or this
        # planner reloaded from disk, accept another planner's plan that shares its number.
        self._token = secrets.randbits(63) | 1
        # The one map of plans made and not yet committed or aborted (owner: _lock); it also
        # names each conversation's plan in flight (a second plan of it is refused, or its
        # second turn would re-send what the first sends).
        self._leases = PlanLeases()
        # The shared-store link (None: local state only, or fallen back to it).
        self._sync: SharedSync | None = None
        self.store_fallback: str | None = None  # why a ?fallback=memory planner went local
        if store is not None:
            # Shared: the conversations follow the log alone (turns in flight stay local).
            self.conversations.replicated = True
            shared = SharedState(as_store(store), namespace)
            sync = SharedSync(self, shared, self._leases, self._replay_clock)
            try:
                shared.store.attach(namespace, config_fingerprint(self.config))
            except StoreUnavailable as e:
                if not sync.fall_back(e):
                    raise
            else:
                self._sync = sync
                with self._lock:
                    sync.pull()

    # ---- the two steps ------------------------------------------------------------------------

    def plan(
        self, chunks: Iterable[Chunk], conversation_id: str | None = None
    ) -> Plan:
        """Order (and, with a conversation id, deduplicate) one request's chunks. Reads state;
        changes nothing but the pending-plan list.

        ``chunks`` may be any iterable (a generator is read exactly once). ``ValueError``
        (nothing changed) for non-Chunk items or a conversation id that is not a non-empty
        string or None (:func:`craft_rag.validation.validate_conversation_id`).
        ``RuntimeError`` if the conversation already has a plan in flight (made, neither
        committed nor aborted): its next turn can only be planned once the earlier one is
        recorded, or it would re-send the earlier turn's chunks. A plan in flight longer than
        ``conversation_ttl_s`` is abandoned instead (it can no longer be committed).
        """
        if type(chunks) is not list and type(chunks) is not tuple:
            chunks = materialise(chunks, "chunks")
        # The items must be Chunks (a Chunk checked its fields when it was built); keys
        # repeated within the request are split off (the first occurrence is kept).
        repeated: Sequence[Chunk] = ()
        fresh: Sequence[Chunk] = chunks  # the distinct chunks, in input (rank) order
        if set(map(type, chunks)) <= _ONLY_CHUNKS:  # C-level check: plain Chunks only
            unique = {c.key: c for c in chunks}
            if len(unique) != len(chunks):  # a repeated key
                unique, repeated = split_repeats(chunks)
                fresh = list(unique.values())
        else:  # a Chunk subclass or not a Chunk
            unique, repeated = split_repeats(chunks)
            fresh = list(unique.values())
        conv = None if conversation_id is None else validate_conversation_id(conversation_id)

        with self._lock:
            if self._sync is not None:
                self._sync.pull()
            if conv is not None:
                ttl = self.config.conversation_ttl_s
                self._leases.check_not_in_flight(conv, self._clock(), ttl)
            removed: Sequence[Chunk] = ()
            turn = 1
            if conv is not None:
                turn = self.conversations.turn_count(conv) + 1
                if self.config.dedup:
                    fresh, removed = self.conversations.split(conv, fresh)
            context = self._context
            if (
                context.access_table is not self.access_table
                or context.prefix_tree is not self.prefix_tree
            ):  # state replaced (a load, a store snapshot)
                context = self._context = OrderingContext(self.access_table, self.prefix_tree)
            policy = self._policy
            nodes: list[PrefixNode] | None = None
            if type(policy) is TreeOrder:  # its set match's nodes are the order's match
                # ``unique`` maps ``fresh`` unless the conversation removed some (then None)
                by_key = None if removed else unique
                ordered, nodes = policy.order_matched(fresh, context, by_key)
            else:
                ordered = policy.order(fresh, context)
            matched_chunks, matched_tokens = 0, None
            keys = tuple([c.key for c in ordered])
            tree = self.prefix_tree
            if turn == 1:
                if nodes is None:
                    nodes = tree.match_nodes(keys)
                matched_chunks = len(nodes)
                matched_tokens = nodes[-1].token_end if nodes else 0
            else:
                nodes = None  # a later turn leaves the tree as it is
            plan = made_plan(
                next(self._plan_ids), tuple(ordered), tuple(removed) if removed else (),
                tuple(repeated), matched_chunks, matched_tokens, conv, turn, policy.name,
                self._token, keys,
            )
            sync = self._sync
            seen = sync.shared.applied if sync is not None else 0
            # The first turn's match, which commit reads while the tree is unchanged.
            lease = PlanLease(plan, seen, self._clock(), False, False, tree, tree.version, nodes)
            self._leases.add(lease, _MAX_PENDING)
            if conv is not None and turn > 1:  # never evicted until its commit or abort:
                self.conversations.hold(conv)
            self.stats.plans += 1
        return plan

    # ---- the lease: claim -> commit | abort (the rest: craft_rag.planner.leases.LeaseDesk) --

    def abort(self, plan: Plan) -> bool:
        """Give up ``plan`` (it will not be served): it can no longer be committed, and its
        conversation may be planned again (its hold in the conversation store ends). Changes no
        other state. True if the plan was pending here; False if it was already committed,
        aborted, too old, or made by another planner.
        ``ValueError`` if ``plan`` is not a :class:`Plan`. O(1)."""
        if not isinstance(plan, Plan):
            msg = f"plan: must be a craft_rag.planner.Plan, got {type(plan).__name__}"
            raise ValueError(msg)
        with self._lock:
            lease = self._leases.finish(plan.plan_id) if plan.planner_token == self._token else None
            if lease is None:
                return False
            if lease.unsettled is not None or lease.written is not None:
                sync = self._sync
                written = (
                    sync.abort_unsettled(lease) if sync is not None else lease.written is not None
                )
                if written:
                    return False  # its commit was written after all: the turn is recorded
            if plan.conversation_id is not None:
                self.conversations.release(plan.conversation_id)
            return True

    def commit(
        self,
        plan: Plan,
        *,
        prefix_tokens: int | None = None,
        chunk_token_counts: Sequence[int] | None = None,
        reused_chunks: int | None = None,
        block_hashes: Sequence[Sequence[BlockHash | int]] | None = None,
        location: KVLocation | None = None,
        turn_tokens: Sequence[int] | None = None,
        removed_in_prompt: bool = False,
    ) -> CommitResult:
        """Record that ``plan`` was served; ``turn_tokens``: the ids the turn leaves in its
        conversation's prompt (recorded with its keys in one ``record_turn``).
        ``removed_in_prompt``: the prompt carried the plan's ``removed_duplicates`` as well,
        after its ordered chunks (a restarted turn, :mod:`craft_rag.engine.turn_layout`): the
        conversation records them with the turn, so a later turn does not send them again.

        ``prefix_tokens`` is the number of prompt tokens before the first chunk; with
        ``chunk_token_counts`` (default: the chunks' ``num_tokens``) it gives each CP-Tree node
        its token span. ``reused_chunks`` is how many leading chunks the engine actually had
        cached (block-granular: a chunk counts when all its full blocks were hits); when it is
        smaller than the tree's match, the stale nodes are removed. ``block_hashes[i]`` are the
        engine's hashes of the full blocks ending inside chunk ``i``. ``RuntimeError`` if the
        plan was already committed, is too old, or was made by another planner (or before a
        load); ``ValueError`` naming the argument for a bad one (mismatched lengths, negative or
        non-int token counts, block hashes that are not bytes or ints, a plan altered after
        planning). Every argument is checked before anything changes: a refused commit changes
        nothing and leaves the plan committable. A store that failed: ``StoreUnavailable``, the
        plan still committable (recorded once; :mod:`craft_rag.planner.sync`).

        Spans are contiguous by construction; a span differing from a cached chunk's recorded
        one replaces that node's KV record and drops the nodes below it
        (:meth:`ChunkPrefixTree.insert`). O(k) plus the tree's insert.
        """
        # The very Plan object plan() returned (a lookup, no lock: only a hint that skips the
        # repeat check; the lease is checked again under the lock).
        made = self._leases.get(plan.plan_id) if type(plan) is Plan else None
        spans, hashes = commit_spans(
            plan, prefix_tokens, chunk_token_counts, reused_chunks, block_hashes, location,
            made_here=made is not None and made.plan is plan,
        )
        tokens = None if turn_tokens is None else check_tokens(turn_tokens)
        if type(removed_in_prompt) is not bool:
            msg = f"removed_in_prompt: must be a bool, got {removed_in_prompt!r}"
            raise ValueError(msg)
        keys = plan.keys

        with self._lock:
            if plan.planner_token != self._token:
                msg = (
                    f"plan {plan.plan_id} was made by another CraftPlanner (or before this one "
                    "was loaded); commit a plan on the planner that made it"
                )
                raise RuntimeError(msg)
            pending = self._leases.get(plan.plan_id)
            if pending is None:
                msg = (
                    f"plan {plan.plan_id} was already committed, aborted, or is too old to "
                    "commit"
                )
                raise RuntimeError(msg)
            if pending.plan is not plan and not pending.matches(plan):
                msg = (
                    f"plan: plan {plan.plan_id} was altered after planning; commit the Plan "
                    "object that plan() returned"
                )
                raise ValueError(msg)
            removed = plan.removed_duplicates
            removed_keys = tuple([c.key for c in removed]) if removed else ()
            applied: Applied | None = None
            sync = self._sync
            if sync is not None:
                metadata = node_metadata(spans, hashes, len(keys))
                entry = CommitEntry(
                    keys, removed_keys, plan.turn, plan.conversation_id, reused_chunks,
                    tuple(metadata) if metadata is not None else None, location,
                    self._replay_clock.base(), removed_in_prompt,
                )
                # Finishes the lease once written (a failed append leaves it committable).
                applied = sync.commit(pending, entry, tokens)
            else:
                self._leases.finish(plan.plan_id)
            if applied is None:  # local state (no store, or fell back to memory)
                served = commit_turn(
                    keys, removed_keys, plan.turn, plan.conversation_id, reused_chunks,
                    location, tokens, removed_in_prompt, spans, hashes,
                )
                tree = self.prefix_tree  # the plan's match while the tree is unchanged:
                nodes = pending.nodes if pending.version == tree.version else None
                applied = self._record(served, nodes if pending.tree is tree else None)
            reused, inserted, stale = applied

            s = self.stats
            s.commits += 1
            repeated = len(plan.repeated_in_request)
            s.chunks_retrieved += len(keys) + len(removed) + repeated  # plan.retrieved_count
            if removed:
                s.chunks_removed_by_dedup += len(removed)
            if repeated:
                s.chunks_repeated_in_request += repeated
            s.predicted_chunks += plan.matched_chunks
            s.reused_chunks += reused
        if sync is not None and sync.snapshot_due is not None:  # written outside the lock
            sync.write_snapshot()
        return made_result(reused, inserted, stale, plan.turn)

    # ---- the shared store (craft_rag.planner.sync): conversation ends and drops are log entries

    @property
    def store(self) -> StateStore | None:
        """The shared store this planner syncs with (None: local state only)."""
        sync = self._sync
        return sync.shared.store if sync is not None else None

    def shared_position(self) -> SharedPosition | None:
        """Store, namespace and last applied seq of a sharing planner (None: local state).
        The engine stores each conversation's prompt history there at this seq. O(1)."""
        with self._lock:
            sync = self._sync
            if sync is None:
                return None
            shared = sync.shared
            return SharedPosition(
                shared.store, shared.namespace, shared.applied, self.config.conversation_ttl_s
            )

    def sync(self) -> None:
        """Apply what other workers committed since the last sync (no-op without a store).
        One round trip."""
        with self._lock:
            if self._sync is not None:
                self._sync.pull()

    def end_conversation(self, conversation_id: str) -> bool:
        """Forget a conversation's sent chunks (in every worker, with a store). True if it was
        known. A plan of it still in flight stays committable (it records a first turn of the
        fresh conversation), but no longer blocks planning the conversation again. ``None``
        (no conversation) returns False; other non-string ids are a ``ValueError``."""
        conv = validate_conversation_id(conversation_id)
        if conv is None:
            return False
        with self._lock:
            self._leases.forget_conversation(conv)
            sync = self._sync
            result = None
            if sync is not None and sync.pull():
                result = sync.push(EndEntry(conv, self._replay_clock.base()), None)
            ended = bool(result[0]) if result is not None else self.conversations.end(conv)
        self._write_snapshot()
        return ended

    def forget_turns(self, conversation_id: str, n: int) -> int:
        """The conversation's prompt dropped its ``n`` oldest turns: chunks only they carried
        are planned as new again (dedup is only correct while the carrying turn is in the
        prompt). Returns the turns forgotten. O(chunks of the remaining turns)."""
        conv = validate_conversation_id(conversation_id)
        check_int(n, "n", minimum=0)
        if conv is None:
            return 0
        with self._lock:
            sync = self._sync
            result = None
            if sync is not None and sync.pull() and n > 0:
                result = sync.push(ForgetEntry(conv, n, self._replay_clock.base()), None)
            forgotten = (
                result[0] if result is not None else self.conversations.forget_oldest_turns(conv, n)
            )
        self._write_snapshot()
        return forgotten

    def _write_snapshot(self) -> None:
        """Write a snapshot the last log entry made due (outside the lock), if any."""
        sync = self._sync
        if sync is not None and sync.snapshot_due is not None:
            sync.write_snapshot()

    def _adopt_state(
        self, table: ChunkAccessTable, tree: ChunkPrefixTree, conversations: ConversationStore
    ) -> None:
        """Install a whole new state (a load, a store snapshot): the one place the table, tree
        and conversation store are replaced. ``plan`` rebuilds its ordering context when it
        sees them changed. Caller holds the lock (or owns the planner alone)."""
        self.access_table = table
        self.prefix_tree = tree
        self.conversations = conversations

    def _go_local(self, reason: str) -> None:
        """The store is unreachable and ``?fallback=memory`` is set: drop the shared-store
        component and go on with the state held now (``store_fallback`` says why)."""
        self.store_fallback = reason
        self._sync = None

    def now(self) -> float:
        """The planner's clock (``time.time`` with a store, else as given). O(1)."""
        return self._clock()

    # ---- persistence (to_json / save and the codec: craft_rag.planner.io) --------------------

    @classmethod
    def from_json(
        cls, data: dict[str, Any], *, clock: Callable[[], float] = time.monotonic
    ) -> CraftPlanner:
        """Rebuild a planner from :meth:`to_json` data, validating the whole structure first.

        Any violation (a foreign format, a missing, unknown or mistyped field, a tree path
        repeating a key, duplicate siblings, parent indices out of pre-order, more nodes or
        conversations than the bounds, a span with start > end or not contiguous, a broken
        LRU order, a table window or tree bound different from the config's) is one
        ``ValueError`` naming the field's JSON path, e.g. ``"prefix_tree.nodes[3].parent:
        ..."``. ``check_invariants()`` holds after every successful load. O(size of the state).
        """
        state = state_from_json(data, clock)
        planner = cls(state.config, clock=clock)
        planner._adopt_state(state.access_table, state.prefix_tree, state.conversations)
        return planner

    @classmethod
    def load(cls, path: str | Path, *, clock: Callable[[], float] = time.monotonic) -> CraftPlanner:
        """Read a file written by :meth:`save` (see :meth:`from_json` for what is checked).
        ``ValueError`` naming the file for text that is not JSON state; ``OSError`` for a
        missing or unreadable file."""
        data = read_state_file(path)
        try:
            return cls.from_json(data, clock=clock)
        except ValueError as exc:
            msg = f"{path}: {exc}"
            raise ValueError(msg) from None

    def check_invariants(self) -> None:
        """Assert the invariants of the table, tree, conversations and leases (tests, stress
        runs, the router's checks). O(state)."""
        self.access_table._check_invariants()
        self.prefix_tree.check_invariants()
        self.conversations._check_invariants()
        self._leases._check_invariants()

    _check_invariants = check_invariants  # the name tests and older callers use
