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
no locking). Each conversation has at most one lease (its next turn can only be planned once
the earlier one is recorded). Cost: every operation O(1) amortised.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from craft_rag.types import ConversationId

if TYPE_CHECKING:
    from craft_rag.plans import Plan
    from craft_rag.prefix_tree import ChunkPrefixTree, PrefixNode


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
    (``tree._matched(plan.keys)``) and that tree's version then; while the version is
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
        if self.tree is tree and self.version == tree._version:
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
