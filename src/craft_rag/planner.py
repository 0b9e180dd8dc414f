"""The CRAFT planner: one entry point from retrieved chunks to the order the engine should see.

``plan()`` reads state and returns a :class:`Plan`; ``commit()`` records what was actually served
(CA-Table counts, CP-Tree promotion/extension with the engine's token spans and block hashes,
the conversation's frozen turn). A plan that is never committed (engine failure) changes nothing.

Thread safety: one lock guards all planner state; ``plan`` and ``commit`` each hold it for O(k)
work (plus the tree policy's set match), so concurrent requests are serialised only for
microseconds while engine work runs outside it. State is owned here: the table, tree and
conversation registry are mutated only inside ``commit`` and the KV-event callbacks.
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from craft_rag.access_table import DEFAULT_WINDOW, ChunkAccessTable
from craft_rag.chunk import Chunk
from craft_rag.conversation import (
    DEFAULT_MAX_CONVERSATIONS,
    DEFAULT_TTL_S,
    ConversationRegistry,
)
from craft_rag.files import check_writable, write_atomic
from craft_rag.ordering import DEFAULT_POLICY, ORDERING_POLICIES, OrderingContext, get_policy
from craft_rag.prefix_tree import (
    DEFAULT_MAX_NODES,
    ChunkPrefixTree,
    KVLocation,
    NodeMetadata,
)
from craft_rag.promotion import PROMOTION_RULES, PromotionInput, get_promotion_rule
from craft_rag.stores import DEFAULT_NAMESPACE, StateStore, StoreUnavailable, as_store
from craft_rag.stores.base import LogRead
from craft_rag.stores.histories import SharedPosition
from craft_rag.stores.shared import (
    CommitEntry,
    EndEntry,
    Entry,
    ForgetEntry,
    ReplayClock,
    SharedState,
    config_fingerprint,
    decode_entry,
)
from craft_rag.types import BlockHash, ChunkKey, ConversationId, as_block_hash
from craft_rag.validation import (
    MAX_INT,
    check_bool,
    check_int,
    check_number,
    check_optional_int,
    materialise,
    state_dict,
    state_error,
    state_format,
    validate_conversation_id,
)

logger = logging.getLogger(__name__)

_FORMAT = "craft-rag/planner/v1"
_MAX_PENDING = 65_536

# The promotion rule each policy uses unless configured: the paper's threshold rule for the
# paper's policies; `served` for `tree`, whose set match needs every served order in the tree.
_DEFAULT_PROMOTION = {"retriever": "threshold", "frequency": "threshold", "tree": "served"}


@dataclass(frozen=True, slots=True)
class _PendingPlan:
    """What the planner remembers of a plan until it is committed or aborted.

    ``seen``: the store seq the plan was made at (0 without a store); ``fingerprint``: a hash
    of the plan's content, so a plan altered after planning (``dataclasses.replace``) is refused
    at commit; ``made_at``: the planner clock when it was made (a conversation's plan in flight
    longer than the conversation TTL is abandoned by the next plan of that conversation)."""

    seen: int
    fingerprint: int
    conversation_id: ConversationId | None
    made_at: float


def _fingerprint(plan: Plan) -> int:
    return hash(
        (
            tuple(c.key for c in plan.ordered),
            tuple(c.key for c in plan.removed_duplicates),
            tuple(c.key for c in plan.repeated_in_request),
            plan.conversation_id,
            plan.turn,
        )
    )


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """Planner settings. ``window=None`` is an unlimited CA-Table window; ``promotion=None``
    picks the policy's default rule (see :mod:`craft_rag.promotion`)."""

    policy: str = DEFAULT_POLICY
    window: int | None = DEFAULT_WINDOW
    threshold: int = 2
    promotion: str | None = None
    max_tree_nodes: int = DEFAULT_MAX_NODES
    dedup: bool = True
    max_conversations: int = DEFAULT_MAX_CONVERSATIONS
    conversation_ttl_s: float | None = DEFAULT_TTL_S

    def __post_init__(self) -> None:
        """``ValueError`` naming the field (``"window: must be ..."``) for any bad setting;
        bools are refused where ints are meant and non-bools where bools are meant."""
        if not isinstance(self.policy, str) or self.policy not in ORDERING_POLICIES:
            msg = (
                f"policy: unknown policy {self.policy!r}; "
                f"choose one of {sorted(ORDERING_POLICIES)}"
            )
            raise ValueError(msg)
        if self.promotion is not None and (
            not isinstance(self.promotion, str) or self.promotion not in PROMOTION_RULES
        ):
            msg = (
                f"promotion: unknown promotion rule {self.promotion!r}; "
                f"choose one of {sorted(PROMOTION_RULES)} or None (the policy's default)"
            )
            raise ValueError(msg)
        check_optional_int(self.window, "window", minimum=1, none_means="unlimited window")
        check_int(self.threshold, "threshold", minimum=1)
        check_int(self.max_tree_nodes, "max_tree_nodes", minimum=1)
        check_bool(self.dedup, "dedup")
        check_int(self.max_conversations, "max_conversations", minimum=1)
        if self.conversation_ttl_s is not None:
            try:
                check_number(self.conversation_ttl_s, "conversation_ttl_s", positive=True)
            except ValueError as exc:
                msg = f"{exc} (or None: no expiry); pass seconds, e.g. 3600.0 for an hour"
                raise ValueError(msg) from None

    @property
    def promotion_rule(self) -> str:
        return self.promotion or _DEFAULT_PROMOTION.get(self.policy, "threshold")


@dataclass(frozen=True, slots=True)
class Plan:
    """What to send for one request.

    ``ordered`` is this turn's chunks in render order. ``removed_duplicates`` were sent in an
    earlier turn of the conversation and are left out; ``repeated_in_request`` repeated a key
    within this request (the first occurrence is kept). Every input chunk is in exactly one of
    the three. ``matched_chunks``/``matched_tokens`` is the CP-Tree's predicted reusable prefix
    (tokens counted from the start of the prompt; None when spans are unknown).
    ``planner_token`` names the planner instance that made the plan: plan ids count per
    instance, so only the maker may commit it.
    """

    plan_id: int
    ordered: tuple[Chunk, ...]
    removed_duplicates: tuple[Chunk, ...]
    repeated_in_request: tuple[Chunk, ...]
    matched_chunks: int
    matched_tokens: int | None
    conversation_id: ConversationId | None
    turn: int
    policy: str
    planner_token: int = 0

    @property
    def keys(self) -> tuple[ChunkKey, ...]:
        return tuple(c.key for c in self.ordered)

    @property
    def retrieved_count(self) -> int:
        return len(self.ordered) + len(self.removed_duplicates) + len(self.repeated_in_request)


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What a commit changed in the CP-Tree."""

    reused_chunks: int
    inserted_path: int
    stale_nodes_removed: int
    turn: int


@dataclass(slots=True)
class PlannerStats:
    """Running totals since creation (or load). Owner: :class:`CraftPlanner`."""

    plans: int = 0
    commits: int = 0
    chunks_retrieved: int = 0
    chunks_removed_by_dedup: int = 0
    chunks_repeated_in_request: int = 0
    predicted_chunks: int = 0
    reused_chunks: int = 0


class CraftPlanner:
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
        self.conversations = ConversationRegistry(
            self.config.max_conversations, self.config.conversation_ttl_s, clock=state_clock
        )
        self.stats = PlannerStats()
        self._plan_ids = itertools.count(1)
        # Random per instance (and per load): a plan id alone would let planner B, or this
        # planner reloaded from disk, accept another planner's plan that shares its number.
        self._token = secrets.randbits(63) | 1
        # plan id -> what commit checks (the store seq it was made at, a content fingerprint).
        self._pending: OrderedDict[int, _PendingPlan] = OrderedDict()
        # A conversation's plan made but neither committed nor aborted: a second plan of the
        # conversation is refused, or its second turn would re-send what the first sends.
        self._in_flight: dict[ConversationId, int] = {}  # owner: _lock
        self._shared: SharedState | None = None
        self.store_fallback: str | None = None  # why a ?fallback=memory planner went local
        if store is not None:
            shared = SharedState(as_store(store), namespace)
            try:
                shared.store.attach(namespace, config_fingerprint(self.config))
            except StoreUnavailable as e:
                if not self._fall_back(shared, e):
                    raise
            else:
                self._shared = shared
                with self._lock:
                    self._pull()

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
        chunks = materialise(chunks, "chunks")
        for i, chunk in enumerate(chunks):
            if not isinstance(chunk, Chunk):
                msg = (
                    f"chunks[{i}] is a {type(chunk).__name__}, not a craft_rag.Chunk; "
                    "build chunks with craft_rag.make_chunk(text, id=...)"
                )
                raise ValueError(msg)
        conv = validate_conversation_id(conversation_id)

        unique: dict[ChunkKey, Chunk] = {}
        repeated: list[Chunk] = []
        for chunk in chunks:
            if chunk.key in unique:
                repeated.append(chunk)
            else:
                unique[chunk.key] = chunk
        fresh = list(unique.values())

        with self._lock:
            self._pull()
            if conv is not None:
                self._check_not_in_flight(conv)
            removed: list[Chunk] = []
            turn = 1
            if conv is not None:
                turn = self.conversations.turn_count(conv) + 1
                if self.config.dedup:
                    fresh, removed = self.conversations.split(conv, fresh)
            context = OrderingContext(self.access_table, self.prefix_tree)
            ordered = self._policy.order(fresh, context)
            matched_chunks, matched_tokens = 0, None
            if turn == 1:
                match = self.prefix_tree.match([c.key for c in ordered])
                matched_chunks, matched_tokens = match.length, match.tokens
            plan = Plan(
                plan_id=next(self._plan_ids),
                ordered=tuple(ordered),
                removed_duplicates=tuple(removed),
                repeated_in_request=tuple(repeated),
                matched_chunks=matched_chunks,
                matched_tokens=matched_tokens,
                conversation_id=conv,
                turn=turn,
                policy=self._policy.name,
                planner_token=self._token,
            )
            seen = self._shared.applied if self._shared is not None else 0
            self._pending[plan.plan_id] = _PendingPlan(
                seen, _fingerprint(plan), conv, self._clock()
            )
            if conv is not None:
                self._in_flight[conv] = plan.plan_id
            if len(self._pending) > _MAX_PENDING:
                old_id, old = self._pending.popitem(last=False)
                self._release(old_id, old)
            self.stats.plans += 1
        return plan

    def _check_not_in_flight(self, conv: ConversationId) -> None:
        """Refuse a second plan of ``conv`` while one is in flight; abandon one older than the
        conversation TTL. Caller holds the lock. O(1)."""
        plan_id = self._in_flight.get(conv)
        if plan_id is None:
            return
        pending = self._pending.get(plan_id)
        ttl = self.config.conversation_ttl_s
        if pending is not None and (ttl is None or self._clock() - pending.made_at <= ttl):
            msg = (
                f"conversation {conv!r} has a plan in flight (plan {plan_id}); commit or abort "
                "it first (planner.commit(plan, ...) once served, planner.abort(plan) if it "
                "will not be served)"
            )
            raise RuntimeError(msg)
        if pending is not None:
            del self._pending[plan_id]
        del self._in_flight[conv]

    def _release(self, plan_id: int, pending: _PendingPlan) -> None:
        """Forget a plan's conversation marker (commit, abort, or dropped as too old)."""
        conv = pending.conversation_id
        if conv is not None and self._in_flight.get(conv) == plan_id:
            del self._in_flight[conv]

    def abort(self, plan: Plan) -> bool:
        """Give up ``plan`` (it will not be served): it can no longer be committed, and its
        conversation may be planned again. Changes no other state. True if the plan was pending
        here; False if it was already committed, aborted, too old, or made by another planner.
        ``ValueError`` if ``plan`` is not a :class:`Plan`. O(1)."""
        if not isinstance(plan, Plan):
            msg = f"plan: must be a craft_rag.planner.Plan, got {type(plan).__name__}"
            raise ValueError(msg)
        with self._lock:
            if plan.planner_token != self._token:
                return False
            pending = self._pending.pop(plan.plan_id, None)
            if pending is None:
                return False
            self._release(plan.plan_id, pending)
            return True

    def in_flight(self, conversation_id: str) -> bool:
        """True if the conversation has a plan made and not yet committed or aborted. O(1)."""
        conv = validate_conversation_id(conversation_id)
        with self._lock:
            plan_id = self._in_flight.get(conv) if conv is not None else None
            return plan_id is not None and plan_id in self._pending

    def is_pending(self, plan: Plan) -> bool:
        """True if ``plan`` was made by this planner and can still be committed. O(1)."""
        if not isinstance(plan, Plan):
            return False
        with self._lock:
            return plan.planner_token == self._token and plan.plan_id in self._pending

    def commit(
        self,
        plan: Plan,
        *,
        prefix_tokens: int | None = None,
        chunk_token_counts: Sequence[int] | None = None,
        reused_chunks: int | None = None,
        block_hashes: Sequence[Sequence[BlockHash | int]] | None = None,
        location: KVLocation | None = None,
    ) -> CommitResult:
        """Record that ``plan`` was served.

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
        nothing and leaves the plan committable.

        Spans are contiguous by construction (each chunk starts where the one before ends). A
        commit whose span for a cached chunk differs from the recorded one (another
        ``prefix_tokens``, a re-tokenized chunk) replaces that node's KV record, and the nodes
        recorded below it under the old span are dropped (see :meth:`ChunkPrefixTree.insert`).
        O(k) plus the tree's insert.
        """
        if not isinstance(plan, Plan):
            msg = (
                f"plan: must be the craft_rag.planner.Plan that plan() returned, "
                f"got {type(plan).__name__}"
            )
            raise ValueError(msg)
        k = len(plan.ordered)
        keys = plan.keys
        if len(set(keys)) != k:
            msg = "plan: its ordered chunks repeat a key; commit the Plan that plan() returned"
            raise ValueError(msg)
        if prefix_tokens is not None:
            check_int(prefix_tokens, "prefix_tokens", minimum=0)
        counts = None
        if chunk_token_counts is not None:
            counts = materialise(chunk_token_counts, "chunk_token_counts")
            if len(counts) != k:
                msg = f"chunk_token_counts: has {len(counts)} entries for {k} chunks"
                raise ValueError(msg)
            for i, count in enumerate(counts):
                check_int(count, f"chunk_token_counts[{i}]", minimum=0)
        hashes = None
        if block_hashes is not None:
            rows = materialise(block_hashes, "block_hashes")
            if len(rows) != k:
                msg = f"block_hashes: has {len(rows)} entries for {k} chunks"
                raise ValueError(msg)
            hashes = [
                tuple(
                    as_block_hash(h, f"block_hashes[{i}][{j}]")
                    for j, h in enumerate(materialise(row, f"block_hashes[{i}]"))
                )
                for i, row in enumerate(rows)
            ]
        if reused_chunks is not None:
            check_int(reused_chunks, "reused_chunks", minimum=0, maximum=k)
        if location is not None and not isinstance(location, KVLocation):
            msg = f"location: must be a KVLocation or None, got {type(location).__name__}"
            raise ValueError(msg)
        metadata = self._node_metadata(plan, prefix_tokens, counts, hashes)

        with self._lock:
            if plan.planner_token != self._token:
                msg = (
                    f"plan {plan.plan_id} was made by another CraftPlanner (or before this one "
                    "was loaded); commit a plan on the planner that made it"
                )
                raise RuntimeError(msg)
            pending = self._pending.get(plan.plan_id)
            if pending is None:
                msg = (
                    f"plan {plan.plan_id} was already committed, aborted, or is too old to "
                    "commit"
                )
                raise RuntimeError(msg)
            if pending.fingerprint != _fingerprint(plan):
                msg = (
                    f"plan: plan {plan.plan_id} was altered after planning; commit the Plan "
                    "object that plan() returned"
                )
                raise ValueError(msg)
            del self._pending[plan.plan_id]
            self._release(plan.plan_id, pending)
            seen = pending.seen
            removed_keys = tuple(c.key for c in plan.removed_duplicates)
            applied: tuple[int, int, int] | None = None
            if self._shared is not None:
                entry = CommitEntry(
                    keys, removed_keys, plan.turn, plan.conversation_id, reused_chunks,
                    tuple(metadata) if metadata is not None else None, location,
                    self._replay_clock.base(),
                )
                applied = self._push(entry, not_after=seen)
            if applied is None:
                applied = self._record(
                    keys, removed_keys, plan.turn, plan.conversation_id, reused_chunks,
                    metadata, location,
                )
            reused, inserted, stale = applied

            s = self.stats
            s.commits += 1
            s.chunks_retrieved += plan.retrieved_count
            s.chunks_removed_by_dedup += len(plan.removed_duplicates)
            s.chunks_repeated_in_request += len(plan.repeated_in_request)
            s.predicted_chunks += plan.matched_chunks
            s.reused_chunks += reused
        return CommitResult(
            reused_chunks=reused, inserted_path=inserted, stale_nodes_removed=stale, turn=plan.turn
        )

    def _record(
        self,
        keys: tuple[ChunkKey, ...],
        removed: tuple[ChunkKey, ...],
        turn: int,
        conversation_id: ConversationId | None,
        reused_chunks: int | None,
        metadata: Sequence[NodeMetadata] | None,
        location: KVLocation | None,
    ) -> tuple[int, int, int]:
        """Apply one served plan to the table, tree and registry (the local commit, and the
        replay of a shared log entry): ``(reused, inserted, stale)``. Caller holds the lock."""
        self.access_table.record([*keys, *removed])
        inserted = stale = 0
        reused = 0
        if turn == 1:
            match = self.prefix_tree.match(keys)
            reused = match.length
            if reused_chunks is not None and reused_chunks < match.length:
                # The engine no longer had that KV: the tree's nodes past it are stale.
                stale = self.prefix_tree.remove(match.nodes[reused_chunks])
                match = match.sliced(reused_chunks)
                reused = reused_chunks
            self.prefix_tree.touch(match)
            depth = self._promotion.promote(
                PromotionInput(keys, reused, self.access_table, self.config.threshold)
            )
            if depth > 0:
                self.prefix_tree.insert(
                    keys[:depth],
                    metadata=metadata[:depth] if metadata is not None else None,
                    location=location or KVLocation(),
                )
                inserted = depth
        if conversation_id is not None:
            self.conversations.record_turn(conversation_id, keys)
        return reused, inserted, stale

    # ---- shared state (store=) ------------------------------------------------------------------

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

    def _push(self, entry: Entry, not_after: int | None) -> tuple[int, int, int] | None:
        """Append ``entry``, apply everything up to it; the entry's own ``_record`` result
        (None when the planner fell back to local state instead)."""
        shared = self._shared
        assert shared is not None
        try:
            read = shared.push(entry, not_after=not_after, ttl_s=self.config.conversation_ttl_s)
        except StoreUnavailable as e:
            if not self._fall_back(shared, e):
                raise
            return None
        return self._apply(shared, read, own_seq=read.head)

    def _apply(
        self, shared: SharedState, read: LogRead, own_seq: int | None
    ) -> tuple[int, int, int] | None:
        if read.snapshot is not None:
            data = json.loads(read.snapshot.state)
            self.access_table = ChunkAccessTable.from_json(data["access_table"])
            self.prefix_tree = ChunkPrefixTree.from_json(
                data["prefix_tree"], clock=self._replay_clock
            )
            self.conversations = ConversationRegistry.from_json(
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

    @staticmethod
    def _node_metadata(
        plan: Plan,
        prefix_tokens: int | None,
        counts: Sequence[int] | None,
        block_hashes: Sequence[Sequence[BlockHash]] | None,
    ) -> list[NodeMetadata] | None:
        if counts is None and all(c.num_tokens is not None for c in plan.ordered):
            counts = [c.num_tokens or 0 for c in plan.ordered]
        if counts is None and block_hashes is None:
            return None
        out: list[NodeMetadata] = []
        pos = prefix_tokens or 0
        if counts is not None and pos + sum(counts) > MAX_INT:
            msg = f"chunk_token_counts: spans past token {MAX_INT}; pass real token counts"
            raise ValueError(msg)
        for i in range(len(plan.ordered)):
            span = None
            if counts is not None:
                span = (pos, pos + counts[i])
                pos += counts[i]
            hashes = tuple(block_hashes[i]) if block_hashes is not None else None
            out.append(NodeMetadata(token_span=span, block_hashes=hashes))
        return out

    # ---- engine feedback (KV events) ----------------------------------------------------------

    def on_blocks_removed(self, hashes: Iterable[BlockHash | int]) -> int:
        """The engine evicted these blocks: drop the CP-Tree nodes owning them (count).
        Hashes are bytes or ints (normalised by :func:`craft_rag.types.as_block_hash`);
        ``ValueError`` (nothing changed) for any other type."""
        with self._lock:
            return self.prefix_tree.remove_blocks(hashes)

    def on_blocks_moved(self, hashes: Iterable[BlockHash | int], location: KVLocation) -> int:
        """The engine moved these blocks to another tier/replica: update node locations."""
        with self._lock:
            return self.prefix_tree.relocate_blocks(hashes, location)

    def on_all_blocks_cleared(self) -> None:
        """The engine dropped its whole prefix cache: empty the CP-Tree."""
        with self._lock:
            self.prefix_tree.clear()

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
            self._in_flight.pop(conv, None)
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

    # ---- persistence --------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            return {
                "format": _FORMAT,
                "config": asdict(self.config),
                "access_table": self.access_table.to_json(),
                "prefix_tree": self.prefix_tree.to_json(),
                "conversations": self.conversations.to_json(),
            }

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
        ..."``. ``_check_invariants()`` holds after every successful load. O(size of the state).
        """
        state_format(data, "", _FORMAT, "planner state")
        state_dict(
            data,
            "",
            required=("format", "config", "access_table", "prefix_tree", "conversations"),
        )
        config = _config_from_json(data["config"])
        planner = cls(config, clock=clock)
        table = ChunkAccessTable.from_json(data["access_table"], path="access_table")
        if table.window != config.window:
            raise state_error(
                "access_table.window",
                f"{table.window} differs from config.window {config.window}",
            )
        tree = ChunkPrefixTree.from_json(data["prefix_tree"], clock=clock, path="prefix_tree")
        if tree.max_nodes != config.max_tree_nodes:
            raise state_error(
                "prefix_tree.max_nodes",
                f"{tree.max_nodes} differs from config.max_tree_nodes {config.max_tree_nodes}",
            )
        conversations = ConversationRegistry.from_json(
            data["conversations"], clock=clock, path="conversations"
        )
        if conversations.max_conversations != config.max_conversations:
            raise state_error(
                "conversations.max_conversations",
                f"{conversations.max_conversations} differs from config.max_conversations "
                f"{config.max_conversations}",
            )
        if conversations.ttl_s != config.conversation_ttl_s:
            raise state_error(
                "conversations.ttl_s",
                f"{conversations.ttl_s} differs from config.conversation_ttl_s "
                f"{config.conversation_ttl_s}",
            )
        planner.access_table = table
        planner.prefix_tree = tree
        planner.conversations = conversations
        return planner

    def save(self, path: str | Path) -> None:
        """Write all state as JSON through :func:`craft_rag.files.write_atomic`: a private
        (0600) temp file in the same folder, never through a symlink, fsync-ed, then renamed
        over ``path``; concurrent saves each install a whole file. ``IsADirectoryError`` /
        ``FileNotFoundError`` / ``PermissionError`` before any work. O(size of the state)."""
        check_writable(path)
        write_atomic(path, json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path, *, clock: Callable[[], float] = time.monotonic) -> CraftPlanner:
        """Read a file written by :meth:`save` (see :meth:`from_json` for what is checked).
        ``ValueError`` naming the file for text that is not JSON state; ``OSError`` for a
        missing or unreadable file."""
        raw = Path(path).read_bytes()
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            msg = f"{path}: not a craft-rag planner state file (not UTF-8 JSON: {exc})"
            raise ValueError(msg) from None
        except ValueError as exc:  # e.g. an integer literal longer than Python reads
            msg = f"{path}: not a craft-rag planner state file ({exc})"
            raise ValueError(msg) from None
        try:
            return cls.from_json(data, clock=clock)
        except ValueError as exc:
            msg = f"{path}: {exc}"
            raise ValueError(msg) from None

    def _check_invariants(self) -> None:
        self.access_table._check_invariants()
        self.prefix_tree._check_invariants()
        self.conversations._check_invariants()


def _config_from_json(value: object) -> PlannerConfig:
    """The saved ``config`` object as a :class:`PlannerConfig`; a missing field takes its
    default, an unknown one is refused. ``ValueError`` naming ``config.<field>``."""
    data = state_dict(value, "config", optional=[f.name for f in fields(PlannerConfig)])
    try:
        return PlannerConfig(**data)
    except ValueError as exc:
        raise ValueError(f"config.{exc}") from None
