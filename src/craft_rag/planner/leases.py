"""Plan leases: the one map of plans made and not yet committed or aborted.

A plan's life is ``plan`` -> (``claim`` -> ``release``)* -> ``commit`` | ``abort``:

- **planned**: made by :meth:`craft_rag.planner.CraftPlanner.plan`; its holder (the caller, a
  framework adapter holding only its id) may claim it;
- **reserved** (optional): a framework adapter found it by its conversation and chunk keys
  (:meth:`PlanLeases.reserve`) and hands its ``ref`` to the engine; no other adapter finds it;
- **claimed**: an engine serves it now; a second claim is refused (a plan is served once at a
  time). A claim whose request failed is released (back to planned: the holder may serve it
  again);
- **committed** or **aborted**: the lease is gone; claiming or committing it again is refused.

Owner: one :class:`PlanLeases` per planner, used only under the planner's lock (this class does
no locking). :class:`LeaseDesk`, a base of the planner, is its public face (``claim``,
``reserve``, ``release``, ...; ``commit`` and ``abort`` are the planner's own). Each
conversation has at most one lease (its next turn can only be planned once the earlier one is
recorded). Cost: every operation O(1) amortised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from craft_rag.conversation import ConversationStore
from craft_rag.planner.plans import Plan, parse_plan_ref
from craft_rag.tree import ChunkPrefixTree, PrefixNode
from craft_rag.types import ChunkKey, ConversationId
from craft_rag.validation import validate_conversation_id


def fingerprint(plan: Plan) -> int:
    """A hash of the plan's content: a plan altered after planning is refused at commit."""
    return hash(
        (
            tuple(c.key for c in plan.ordered),
            tuple(c.key for c in plan.removed_duplicates),
            tuple(c.key for c in plan.repeated_in_request),
            plan.conversation_id,
            plan.turn,
        )
    )


@dataclass(slots=True)
class PlanLease:
    """What the planner keeps of a plan until it is committed or aborted.

    ``seen``: the store seq the plan was made at (0 without a store); ``made_at``: the planner
    clock when it was made (a conversation's plan in flight longer than the conversation TTL
    is abandoned by the next plan of that conversation); ``claimed``: an engine serves it now.
    ``tree`` / ``version`` / ``nodes``: a first turn's CP-Tree match as ``plan()`` found it
    (``tree.match_nodes(plan.keys)``) and that tree's version then; while the version is
    unchanged the match is too, and ``commit`` reads it instead of walking the tree again.
    """

    plan: Plan
    seen: int
    made_at: float
    claimed: bool = field(default=False)
    reserved: bool = field(default=False)
    tree: ChunkPrefixTree | None = field(default=None)
    version: int = field(default=0)
    nodes: list[PrefixNode] | None = field(default=None)
    # A shared store's commit attempts (owner: the planner's shared sync): ``attempts`` made,
    # the token of the last one whose outcome is not known yet (``unsettled``: it may or may
    # not be in the log), the turn's token ids it carries, and its result once a replay of the
    # log met its entry (``written``: committed, whatever the caller was told).
    attempts: int = field(default=0)
    unsettled: str | None = field(default=None)
    tokens: Sequence[int] | None = field(default=None)
    written: tuple[int, int, int] | None = field(default=None)

    def match(self, tree: ChunkPrefixTree) -> list[PrefixNode] | None:
        """The nodes ``plan()`` matched if ``tree`` has not changed since (None otherwise:
        walk it again). O(1)."""
        if self.tree is tree and self.version == tree.version:
            return self.nodes
        return None

    @property
    def fingerprint(self) -> int:
        """:func:`fingerprint` of the plan as made (the plan is frozen)."""
        return fingerprint(self.plan)

    def matches(self, plan: Plan) -> bool:
        """True if ``plan`` is the plan as made: the very object ``plan()`` returned (O(1);
        the common case: the caller commits what it planned), else one whose content
        hashes the same (O(k))."""
        return plan is self.plan or fingerprint(plan) == fingerprint(self.plan)

    @property
    def conversation_id(self) -> ConversationId | None:
        return self.plan.conversation_id


class PlanLeases:
    """plan id -> :class:`PlanLease`, oldest first, plus conversation -> its plan id.

    Invariants: every conversation marker names a lease of that conversation; at most
    ``limit`` leases after :meth:`add` (the oldest are dropped: too old to commit)."""

    def __init__(self) -> None:
        # A plain dict keeps insertion order (oldest first; a lease is never re-inserted) and
        # sets / pops faster than an OrderedDict (a set and a pop per request).
        self._leases: dict[int, PlanLease] = {}
        # ``get(plan_id)``: the lease or None, the dict's own C method (no Python frame).
        self.get: Callable[[int], PlanLease | None] = self._leases.get
        self._by_conversation: dict[ConversationId, int] = {}
        # (conversation, planned keys) -> plan ids, oldest first: what an adapter that passes
        # plain node lists can find a plan by (an index over _leases, not a second owner).
        # Built on the first reserve(): planners no adapter reserves from never pay for it.
        self._by_keys: dict[tuple[ConversationId | None, tuple[str, ...]], list[int]] | None = None

    def __len__(self) -> int:
        return len(self._leases)

    def add(self, lease: PlanLease, limit: int) -> None:
        plan = lease.plan
        plan_id = plan.plan_id
        self._leases[plan_id] = lease
        if plan.conversation_id is not None:
            self._by_conversation[plan.conversation_id] = plan_id
        if self._by_keys is not None:
            self._by_keys.setdefault(_keys_of(lease), []).append(plan_id)
        while len(self._leases) > limit:
            self._drop(next(iter(self._leases)))

    def claim(self, plan_id: int) -> PlanLease:
        """planned -> claimed. ``RuntimeError`` for an unknown (committed, aborted, too old)
        or already claimed plan."""
        lease = self._leases.get(plan_id)
        if lease is None:
            msg = (
                f"plan {plan_id} was already committed, aborted, or is too old to commit; "
                "make a new plan"
            )
            raise RuntimeError(msg)
        if lease.claimed:
            msg = f"plan {plan_id} is already being served; a plan is served once"
            raise RuntimeError(msg)
        lease.claimed = True
        return lease

    def release(self, plan_id: int) -> bool:
        """claimed -> planned (the request serving it failed). False if it was not claimed."""
        lease = self._leases.get(plan_id)
        if lease is None or not lease.claimed:
            return False
        lease.claimed = lease.reserved = False
        return True

    def reserve(
        self, conversation_id: ConversationId | None, keys: tuple[str, ...]
    ) -> PlanLease | None:
        """The oldest lease of exactly these planned keys (in order) and conversation that is
        neither reserved nor claimed, now reserved; None if there is none. O(plans with
        those keys; the first call builds the index, O(plans))."""
        by_keys = self._by_keys
        if by_keys is None:
            by_keys = self._by_keys = {}
            for plan_id, lease in self._leases.items():
                by_keys.setdefault(_keys_of(lease), []).append(plan_id)
        for plan_id in by_keys.get((conversation_id, keys), ()):
            lease = self._leases[plan_id]
            if not lease.reserved and not lease.claimed:
                lease.reserved = True
                return lease
        return None

    def waiting(self) -> int:
        """Leases neither reserved nor claimed (plans parked for an adapter). O(leases)."""
        return sum(1 for lease in self._leases.values() if not lease.reserved and not lease.claimed)

    def finish(self, plan_id: int) -> PlanLease | None:
        """planned or claimed -> gone (commit, abort). None if there was no lease. O(1)."""
        lease = self._leases.pop(plan_id, None)
        if lease is not None and (
            self._by_keys is not None or lease.plan.conversation_id is not None
        ):
            self._unindex(plan_id, lease)
        return lease

    def of_conversation(self, conversation_id: ConversationId) -> PlanLease | None:
        """The conversation's lease (made, neither committed nor aborted), if any. O(1)."""
        plan_id = self._by_conversation.get(conversation_id)
        return self._leases.get(plan_id) if plan_id is not None else None

    def check_not_in_flight(
        self, conversation_id: ConversationId, now: float, ttl_s: float | None
    ) -> None:
        """Refuse (``RuntimeError``) a second plan of a conversation while one is in flight;
        a lease older than ``ttl_s`` is abandoned instead (it can no longer be committed)."""
        lease = self.of_conversation(conversation_id)
        if lease is None:
            return
        if ttl_s is None or now - lease.made_at <= ttl_s:
            msg = (
                f"conversation {conversation_id!r} has a plan in flight (plan "
                f"{lease.plan.plan_id}); commit or abort it first (planner.commit(plan, ...) "
                "once served, planner.abort(plan) if it will not be served)"
            )
            raise RuntimeError(msg)
        self.finish(lease.plan.plan_id)

    def forget_conversation(self, conversation_id: ConversationId) -> None:
        """The conversation no longer blocks planning (its lease, if any, stays committable)."""
        self._by_conversation.pop(conversation_id, None)

    def claimed(self) -> list[int]:
        """Ids of the plans being served now (tests, diagnostics). O(leases)."""
        return [plan_id for plan_id, lease in self._leases.items() if lease.claimed]

    def _drop(self, plan_id: int) -> None:
        self._unindex(plan_id, self._leases.pop(plan_id))

    def _unindex(self, plan_id: int, lease: PlanLease) -> None:
        """Drop the indexes' entries of ``lease`` (already out of ``_leases``)."""
        if self._by_keys is not None:
            key = _keys_of(lease)
            same = self._by_keys[key]
            same.remove(plan_id)
            if not same:
                del self._by_keys[key]
        conv = lease.conversation_id
        if conv is not None and self._by_conversation.get(conv) == plan_id:
            del self._by_conversation[conv]

    def _check_invariants(self) -> None:
        if self._by_keys is not None:
            indexed = sorted(i for ids in self._by_keys.values() for i in ids)
            assert indexed == sorted(self._leases)
        for conv, plan_id in self._by_conversation.items():
            lease = self._leases.get(plan_id)
            assert lease is not None and lease.conversation_id == conv


def _keys_of(lease: PlanLease) -> tuple[ConversationId | None, tuple[str, ...]]:
    return lease.conversation_id, tuple(lease.plan.keys)


class LeaseDesk:
    """The lease operations of :class:`~craft_rag.planner.CraftPlanner` (a base of it): claim,
    reserve, release and look up plans by the :class:`PlanLeases` it owns, under its lock."""

    conversations: ConversationStore
    _lock: threading.Lock
    _leases: PlanLeases
    _token: int

    def _lease_id(self, plan: Plan | int | str) -> int | None:
        """The plan id ``plan`` names here, or None when another planner made it."""
        token, plan_id = parse_plan_ref(plan)
        return None if token is not None and token != self._token else plan_id

    def claim(self, plan: Plan | int | str) -> Plan:
        """Take the plan to serve it (an engine does this): ``plan`` is the :class:`Plan`, its
        :attr:`Plan.ref` or its ``plan_id``. Returns the plan as made. ``RuntimeError`` for a
        plan of another planner, one already claimed (being served), committed, aborted or too
        old; ``ValueError`` for something that names no plan. O(1)."""
        plan_id = self._lease_id(plan)
        with self._lock:
            if plan_id is None:
                msg = (
                    f"plan {parse_plan_ref(plan)[1]} was made by another CraftPlanner (or before "
                    "this one was loaded); serve it with the planner that made it"
                )
                raise RuntimeError(msg)
            lease = self._leases.claim(plan_id)
            if isinstance(plan, Plan) and not lease.matches(plan):
                self._leases.release(plan_id)
                msg = (
                    f"plan: plan {plan_id} was altered after planning; pass the Plan object "
                    "that plan() returned"
                )
                raise ValueError(msg)
            return lease.plan

    def made(self, plan: Plan | int | str) -> bool:
        """True if ``plan`` (a :class:`Plan` or its ``ref``) was made by this planner instance,
        pending or not; a bare ``plan_id`` names no maker (False). O(1)."""
        token, _ = parse_plan_ref(plan)
        return token == self._token

    def reserve(self, conversation_id: str | None, keys: Sequence[ChunkKey]) -> Plan | None:
        """For a framework adapter that passes plain node lists: the oldest plan of exactly
        these planned ``keys`` (in order) and conversation that no one reserved or claimed yet,
        now reserved for the caller, who hands its ``ref`` to the engine (the engine claims
        it); None if there is none. ``waiting()`` counts the plans still parked. O(1)-ish."""
        conv = validate_conversation_id(conversation_id)
        with self._lock:
            lease = self._leases.reserve(conv, tuple(keys))
            return lease.plan if lease is not None else None

    def waiting(self) -> int:
        """Plans made and neither reserved, claimed, committed nor aborted. O(plans)."""
        with self._lock:
            return self._leases.waiting()

    def pending_plan(self, plan: Plan | int | str) -> Plan | None:
        """The plan ``plan`` (a :class:`Plan`, its ``ref`` or ``plan_id``) names if it can still
        be claimed or committed here; None otherwise (another planner's, committed, aborted,
        too old). ``ValueError`` for something that names no plan. Read-only, O(1)."""
        plan_id = self._lease_id(plan)
        with self._lock:
            lease = self._leases.get(plan_id) if plan_id is not None else None
            return lease.plan if lease is not None else None

    def release(self, plan: Plan) -> bool:
        """The claimed ``plan`` was not served (engine failure, abort): it goes back to its
        holder, who may serve it again. False if it was not claimed here. O(1)."""
        plan_id = self._lease_id(plan)
        with self._lock:
            return plan_id is not None and self._leases.release(plan_id)

    def in_flight(self, conversation_id: str) -> bool:
        """True if the conversation has a plan made and not yet committed or aborted. O(1)."""
        conv = validate_conversation_id(conversation_id)
        with self._lock:
            return conv is not None and self._leases.of_conversation(conv) is not None

    def is_pending(self, plan: Plan) -> bool:
        """True if ``plan`` was made by this planner and can still be committed. O(1)."""
        if not isinstance(plan, Plan):
            return False
        with self._lock:
            return plan.planner_token == self._token and self._leases.get(plan.plan_id) is not None

    def committed_turns(self, conversation_id: str) -> int:
        """Turns of the conversation committed so far (0: unknown or expired). O(1)."""
        conv = validate_conversation_id(conversation_id)
        with self._lock:
            return self.conversations.turn_count(conv) if conv is not None else 0
