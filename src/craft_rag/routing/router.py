"""The router: place a request on a replica and plan its chunk order there, in one step.

``route()`` picks the replica with the routing policy (see :mod:`craft_rag.routing.policies`),
then plans the request on that replica's planner for the request's salt; the caller serves
``decision.plan`` on ``decision.replica``, commits it on that planner (an engine with
``plan=`` does this itself) and calls :meth:`Router.finish`. A decision never finished keeps
its load counted; a plan never committed changes no tree.

Conversations are scoped by tenant: a conversation is its (salt, id) pair, so the same id under
two salts is two conversations with their own homes, turns and ends, and nothing the router
answers or raises tells one tenant that another uses an id (or shows a salt). Conversations
stay on their replica while it is healthy (their history is cached there). When a replica
goes down its trees and load are dropped and its conversations are re-homed now, on the
least-loaded healthy replicas; their next turn restarts there as a first turn
(``decision.rehomed``). A replica that comes back rejoins empty.

Several app workers (``shared=``, a :class:`~craft_rag.routing.shared_state.RoutingState`):
each worker's router reads the other workers' loads and the shared conversation homes before
each decision, pulls each replica's planner from its store, and publishes its own load after
each routing call, so N routers decide as one would (see :mod:`craft_rag.routing.shared_state`
for what is exact and what is eventually consistent). Without it (the default) all of this is
local, as with one router.

Thread safety: one lock around every public method; the planner's own lock is taken inside it
(lock order: router, then planner; the shared state's calls are made under the router lock).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

from craft_rag.chunk import Chunk
from craft_rag.planner import CraftPlanner, Plan, PlannerConfig
from craft_rag.routing.load_index import LoadIndex
from craft_rag.routing.policies import ClusterView, RouteRequest, get_routing_policy
from craft_rag.routing.replica import (
    ConversationKey,
    PlannerSource,
    Replica,
    ReplicaId,
    ReplicaLoad,
)
from craft_rag.routing.router_types import FaultReport, RouteDecision, RouterConfig, RouterStats
from craft_rag.routing.shared_state import RoutingState
from craft_rag.tree import KVLocation
from craft_rag.types import BlockHash, ChunkKey, ConversationId

__all__ = ["FaultReport", "RouteDecision", "Router", "RouterConfig", "RouterStats"]

class Router:
    """KV-aware placement + ordering across replicas.

    Invariants (:meth:`_check_invariants`): each replica's load equals the sum over its
    unfinished decisions; every homed conversation's home is healthy and lists it; unhealthy
    replicas hold no trees, load or conversations.
    """

    def __init__(
        self,
        replicas: Sequence[str],
        policy: str = "craft_joint",
        config: RouterConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        planner_sources: Mapping[str, PlannerSource] | None = None,
        shared: RoutingState | None = None,
    ) -> None:
        """``shared``: routing state shared with other workers' routers (None: this router's
        own, in memory)."""
        if isinstance(replicas, str) or not isinstance(replicas, Sequence) or not replicas:
            msg = "replicas must be a non-empty list of replica names, e.g. ['r0', 'r1']"
            raise ValueError(msg)
        names = [str(r) for r in replicas]
        if len(set(names)) != len(names) or not all(names):
            msg = f"replica names must be distinct non-empty strings, got {names!r}"
            raise ValueError(msg)
        self.config = config or RouterConfig()
        self.policy = get_routing_policy(policy)
        planner_config = replace(
            self.config.planner, policy=self.policy.ordering, promotion="served"
        )
        self._planner_config = planner_config
        sources = dict(planner_sources or {})
        unknown = set(sources) - set(names)
        if unknown:
            msg = f"planner_sources names unknown replicas {sorted(unknown)}; valid: {names}"
            raise ValueError(msg)
        self._replicas: dict[ReplicaId, Replica] = {
            ReplicaId(n): Replica(ReplicaId(n), i, planner_config, clock, sources.get(n))
            for i, n in enumerate(names)
        }
        self._order: tuple[Replica, ...] = tuple(self._replicas.values())
        # Derived from the replicas' health and loads; refreshed where those change.
        self._healthy: tuple[Replica, ...] = self._order
        self._assigned_total = 0
        self._loads = LoadIndex(self._order)
        c = self.config
        self._cluster = ClusterView(
            self._healthy, self._holders, 0, c.ttft_model, c.load_weight, c.balance_slack,
            c.balance_headroom, c.block_size, self._loads, c.tier_costs,
        )
        # Hint: (salt, chunk key) -> indexes of replicas whose tree may have that key at its
        # root. Added when a first turn is planned there, pruned on use against the trees, so
        # a stale entry costs one probe and a tree can never hold a root the hint lacks (its
        # roots come only from plans this router made). An entry whose plan is still in
        # flight (routed, not finished: its commit has not landed) is kept although the tree
        # lacks the root yet: _planned counts those. Engine-owned planners can gain roots
        # behind our back, so with planner_sources every replica is scanned instead.
        self._roots: dict[tuple[str | None, ChunkKey], set[int]] = {}
        self._planned: dict[tuple[str | None, ChunkKey, int], int] = {}
        self._scan_all = bool(sources)
        # Keyed by (salt, conversation id): tenants' conversations never meet.
        self._homes: dict[ConversationKey, ReplicaId] = {}
        self._restart: set[ConversationKey] = set()
        self._inflight: dict[int, RouteDecision] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.stats = RouterStats()
        # Several workers: the others' loads now in each replica's load (subtracted back for
        # what this router publishes as its own). Owner: _lock.
        self._shared = shared
        self._remote: dict[ReplicaId, ReplicaLoad] = {}

    # ---- reading -------------------------------------------------------------------------------

    @property
    def planner_config(self) -> PlannerConfig:
        """The settings every replica planner uses under this policy (give engine-owned
        planners the same: ``engine.set_planner(CraftPlanner(router.planner_config))``)."""
        return self._planner_config

    @property
    def replica_ids(self) -> tuple[ReplicaId, ...]:
        return tuple(r.id for r in self._order)

    def replica(self, replica_id: str) -> Replica:
        """The replica record (read it; the router owns it). ``KeyError`` names valid ids."""
        try:
            return self._replicas[ReplicaId(replica_id)]
        except KeyError:
            msg = f"unknown replica {replica_id!r}; valid: {list(self._replicas)}"
            raise KeyError(msg) from None

    def planner(self, replica_id: str, salt: str | None = None) -> CraftPlanner:
        """The planner holding ``replica_id``'s CP-Tree for ``salt`` (commit plans on it)."""
        with self._lock:
            return self.replica(replica_id).planner(salt)

    def load(self) -> dict[ReplicaId, ReplicaLoad]:
        """A copy of every replica's load (with shared state: every live worker's, read now).
        O(N)."""
        with self._lock:
            if self._shared is not None:
                self._pull_loads()
            return {r.id: replace(r.load) for r in self._order}

    def home(self, conversation_id: str, *, salt: str | None = None) -> ReplicaId | None:
        """The replica homing ``salt``'s conversation ``conversation_id`` (None: unknown). With
        shared state: the shared home (another worker's too), None for one this router does
        not know."""
        with self._lock:
            conv = (salt, ConversationId(conversation_id))
            if self._shared is None:
                return self._homes.get(conv)
            found = self._shared.home(conv)
            return found if found in self._replicas else None

    # ---- routing -------------------------------------------------------------------------------

    def route(
        self,
        chunks: Sequence[Chunk],
        *,
        prompt_tokens: int,
        conversation_id: str | None = None,
        salt: str | None = None,
    ) -> RouteDecision:
        """Choose a replica and plan ``chunks`` there. ``prompt_tokens``: the prompt's length
        (any order). Counts the request as in flight until :meth:`finish`. A conversation is
        ``salt``'s: the same id under another salt is another conversation. ``ValueError`` for
        bad arguments; ``RuntimeError`` if no replica is healthy. Cost: the policy (O(N * k)
        probes + a few set matches) plus one plan."""
        not_int = isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int)
        if not_int or prompt_tokens < 1:
            msg = f"prompt_tokens must be the prompt length (int >= 1), got {prompt_tokens!r}"
            raise ValueError(msg)
        if salt is not None and (not isinstance(salt, str) or not salt):
            got = "an empty string" if salt == "" else f"a {type(salt).__name__}"
            msg = f"salt must be a non-empty string or None, got {got}"
            raise ValueError(msg)
        if conversation_id is not None and (
            not isinstance(conversation_id, str) or not conversation_id
        ):
            msg = f"conversation_id must be a non-empty string or None, got {conversation_id!r}"
            raise ValueError(msg)
        chunks = tuple(chunks)
        for i, chunk in enumerate(chunks):
            if type(chunk) is not Chunk and not isinstance(chunk, Chunk):
                msg = f"chunks[{i}] is a {type(chunk).__name__}, not a craft_rag.Chunk"
                raise ValueError(msg)
        cid = ConversationId(conversation_id) if conversation_id is not None else None
        conv = (salt, cid) if cid is not None else None
        keys = tuple(dict.fromkeys([c.key for c in chunks]))
        request = RouteRequest(chunks, keys, prompt_tokens, cid, salt, frozenset(keys))
        with self._lock:
            view = self._view()
            if not view.healthy:
                msg = "no healthy replica: mark one up with Router.mark_up(replica_id)"
                raise RuntimeError(msg)
            home = self._homes.get(conv) if conv is not None else None
            rehomed = conv is not None and conv in self._restart
            lost: ReplicaId | None = None
            if self._shared is not None:
                self._pull_shared(salt)
                view = self._view()
                if conv is not None:
                    home, rehomed, lost = self._shared_home(conv, home, rehomed)
            if home is not None:
                replica, sticky = self._replicas[home], True
            else:
                choice = self.policy.choose(request, view)
                replica, sticky = choice.replica, False
                if self._shared is not None and conv is not None:
                    winner = self._claim(conv, replica.id, lost)
                    if winner != replica.id:  # another worker homed it first: go there
                        replica, sticky = self._replicas[winner], True
            planner = replica.planner(salt)
            plan_started = time.perf_counter_ns()
            plan = planner.plan(chunks, conversation_id)
            plan_ns = time.perf_counter_ns() - plan_started
            if plan.turn == 1 and plan.ordered:
                root = (salt, plan.ordered[0].key)
                entry = self._roots.get(root)
                if entry is None:
                    self._roots[root] = {replica.index}
                else:
                    entry.add(replica.index)
                planned = (salt, plan.ordered[0].key, replica.index)
                self._planned[planned] = self._planned.get(planned, 0) + 1
            if sticky:
                if plan.turn > 1 and not rehomed:
                    cached = self._history_tokens(plan, prompt_tokens)
                elif plan.turn > 1:  # a history carried to a new home: none of it cached there
                    cached = 0
                else:  # the home planner forgot it: a first turn, predicted from its tree
                    cached = plan.matched_tokens or 0
                cached = max(0, min(cached, prompt_tokens - 1))
                cached -= cached % self.config.block_size
                choice = view.candidate(replica, request, cached)
            work = self.config.ttft_model.predict(
                prompt_tokens - choice.predicted_cached_tokens, choice.predicted_cached_tokens
            )
            if choice.tier_s:  # loading tier-only KV is prefill work too
                work += choice.tier_s
            decision = RouteDecision(
                decision_id=next(self._ids),
                replica=replica.id,
                plan=plan,
                salt=salt,
                prompt_tokens=prompt_tokens,
                predicted_cached_tokens=choice.predicted_cached_tokens,
                predicted_work_s=work,
                predicted_cost_s=choice.cost_s,
                sticky=sticky,
                rehomed=rehomed,
                epoch=replica.epoch,
                plan_ns=plan_ns,
            )
            load = replica.load
            load.requests += 1
            load.prompt_tokens += prompt_tokens
            load.work_s += work
            load.assigned += 1
            self._assigned_total += 1
            self._loads.update(replica)
            self._inflight[decision.decision_id] = decision
            if conv is not None:
                self._homes[conv] = replica.id
                replica.conversations.add(conv)
                self._restart.discard(conv)
            if self._shared is not None:
                self._publish()
            s = self.stats
            s.decisions += 1
            s.sticky += sticky
            s.rehomed_turns += rehomed
            return decision

    @staticmethod
    def _history_tokens(plan: Plan, prompt_tokens: int) -> int:
        # A later turn's prompt starts with the previous prompt and answer, all cached on its
        # home replica; this turn's new chunks and question are not. Unknown sizes -> 0.
        new = sum(c.num_tokens or 0 for c in plan.ordered)
        return max(0, prompt_tokens - new) if new else 0

    def finish(self, decision: RouteDecision) -> bool:
        """The request left its replica (served or failed): stop counting its load. Returns
        False (and changes nothing) when the replica went down since, or it was finished
        already. O(1)."""
        with self._lock:
            if self._inflight.pop(decision.decision_id, None) is None:
                return False
            self._unplanned(decision)
            replica = self._replicas[decision.replica]
            if replica.epoch != decision.epoch or not replica.healthy:
                return False
            load = replica.load
            load.requests -= 1
            load.prompt_tokens -= decision.prompt_tokens
            load.work_s = max(0.0, load.work_s - decision.predicted_work_s)
            if load.requests == 0:
                load.work_s = 0.0  # no float drift left behind
            self._loads.update(replica)
            if self._shared is not None:
                self._publish()
            return True

    def end_conversation(self, conversation_id: str, *, salt: str | None = None) -> bool:
        """Forget ``salt``'s conversation's home (and its sent chunks there); another salt's
        conversation with the same id stays. True if it was known."""
        with self._lock:
            conv = (salt, ConversationId(conversation_id))
            home = self._homes.pop(conv, None)
            self._restart.discard(conv)
            if self._shared is not None:
                shared_home = self._shared.home(conv)
                ended = self._shared.end_home(conv)
                if home is None and shared_home in self._replicas:
                    home = shared_home  # homed by another worker: end it on that replica
                elif home is None:
                    return ended
            if home is None:
                return False
            replica = self._replicas[home]
            replica.conversations.discard(conv)
            replica.planner(salt).end_conversation(conversation_id)
            return True

    # ---- KV events -----------------------------------------------------------------------------

    def on_blocks_removed(
        self, replica_id: str, hashes: Iterable[BlockHash], salt: str | None = None
    ) -> int:
        """``replica_id`` evicted these blocks: drop the tree nodes owning them (count). Events
        from a replica that is down are ignored (its trees are gone)."""
        with self._lock:
            replica = self.replica(replica_id)
            if not replica.healthy or replica.tree(salt) is None:
                return 0
            return replica.planner(salt).on_blocks_removed(hashes)

    def on_blocks_moved(
        self,
        replica_id: str,
        hashes: Iterable[BlockHash],
        tier: str | None,
        salt: str | None = None,
    ) -> int:
        """``replica_id`` now holds these blocks only in KV tier ``tier``
        (:data:`~craft_rag.routing.tier_costs.RAM_MEDIUM` or
        :data:`~craft_rag.routing.tier_costs.DISK_MEDIUM`), or in its pool again (``None``):
        the nodes owning them get that location, which the cost reads (an unknown tier name
        costs as the pool). Returns nodes changed; events from a replica that is down are
        ignored. O(len(hashes))."""
        location = KVLocation() if tier is None else KVLocation(tier=tier)
        with self._lock:
            replica = self.replica(replica_id)
            if not replica.healthy or replica.tree(salt) is None:
                return 0
            return replica.planner(salt).on_blocks_moved(hashes, location)

    def on_all_blocks_cleared(self, replica_id: str) -> None:
        """``replica_id`` dropped its whole prefix cache: empty its trees."""
        with self._lock:
            replica = self.replica(replica_id)
            if replica.healthy:
                for salt in list(replica._planners):
                    replica.planner(salt).on_all_blocks_cleared()

    # ---- faults --------------------------------------------------------------------------------

    def mark_down(self, replica_id: str) -> FaultReport:
        """``replica_id`` failed: drop its trees and load, re-home its conversations on the
        least-loaded healthy replicas (spread one by one). Idempotent. O(N * conversations)."""
        with self._lock:
            replica = self.replica(replica_id)
            if not replica.healthy:
                return FaultReport(replica.id, 0, 0, ())
            # By id (then unsalted first, then salt): a stable order for the report.
            convs = sorted(
                replica.conversations, key=lambda k: (k[1], k[0] is not None, k[0] or "")
            )
            lost = replica.load.requests - self._remote.pop(replica.id, ReplicaLoad()).requests
            self._assigned_total -= replica.load.assigned
            dropped = replica.go_down()
            self._loads.update(replica)
            self._healthy = tuple(r for r in self._order if r.healthy)
            self.stats.faults += 1
            for decision_id in [d for d, x in self._inflight.items() if x.replica == replica.id]:
                self._unplanned(self._inflight.pop(decision_id))
            view = self._view()
            moved: list[tuple[ConversationId, ReplicaId | None]] = []
            extra = {r.id: 0 for r in view.healthy}
            for conv in convs:
                if not view.healthy:
                    del self._homes[conv]
                    self._restart.discard(conv)
                    moved.append((conv[1], None))
                    continue
                target = min(
                    view.healthy,
                    key=lambda r: (len(r.conversations) + extra[r.id], r.load.work_s, r.index),
                )
                if self._shared is not None:  # another worker may have re-homed it already
                    winner = self._claim(conv, target.id, replica.id)
                    target = self._replicas[winner] if winner != target.id else target
                extra[target.id] += 1
                self._homes[conv] = target.id
                target.conversations.add(conv)
                self._restart.add(conv)
                moved.append((conv[1], target.id))
            if self._shared is not None:
                self._publish()
            return FaultReport(replica.id, dropped, lost, tuple(moved))

    def mark_up(self, replica_id: str) -> None:
        """``replica_id`` is back: it rejoins empty (no trees, load or conversations)."""
        with self._lock:
            replica = self.replica(replica_id)
            if not replica.healthy:
                replica.come_up()
                self._remote.pop(replica.id, None)
                self._loads.update(replica)
                self._healthy = tuple(r for r in self._order if r.healthy)

    def close(self) -> None:
        """Withdraw this router's published load from the shared state (no-op without one)."""
        with self._lock:
            if self._shared is not None:
                self._shared.close()

    # ---- shared state (several workers) ---------------------------------------------------------

    def _pull_shared(self, salt: str | None) -> None:
        """Before a decision: the other workers' loads into each healthy replica's load, and
        each healthy replica's planner for ``salt`` synced with its store (what the other
        workers committed). One round trip for the loads plus one per replica."""
        self._pull_loads()
        for r in self._healthy:
            r.planner(salt).sync()

    def _pull_loads(self) -> None:
        """The other workers' loads into each healthy replica's load. One round trip."""
        assert self._shared is not None
        others = self._shared.other_loads()
        zero = ReplicaLoad()
        for r in self._healthy:
            new = others.get(r.id, zero)
            old = self._remote.get(r.id, zero)
            if new != old:
                load = r.load
                load.requests += new.requests - old.requests
                load.prompt_tokens += new.prompt_tokens - old.prompt_tokens
                load.work_s = max(0.0, load.work_s + new.work_s - old.work_s)
                load.assigned += new.assigned - old.assigned
                self._assigned_total += new.assigned - old.assigned
                self._remote[r.id] = replace(new)
                self._loads.update(r)

    def _own(self, replica: Replica) -> ReplicaLoad:
        """This router's own part of ``replica``'s load."""
        remote = self._remote.get(replica.id)
        load = replica.load
        if remote is None:
            return replace(load)
        return ReplicaLoad(
            load.requests - remote.requests,
            load.prompt_tokens - remote.prompt_tokens,
            max(0.0, load.work_s - remote.work_s),
            load.assigned - remote.assigned,
        )

    def _publish(self) -> None:
        assert self._shared is not None
        self._shared.publish_loads({r.id: self._own(r) for r in self._healthy})

    def _claim(
        self, conv: ConversationKey, replica: ReplicaId, lost: ReplicaId | None
    ) -> ReplicaId:
        """Claim ``conv``'s shared home for ``replica`` (replacing ``lost``); the home after
        it. A home this router holds down (another worker has not seen the loss yet) is
        replaced once more; one it does not know is overwritten."""
        assert self._shared is not None
        winner = self._shared.claim_home(conv, replica, replacing=lost)
        if winner == replica:
            return replica
        known = self._replicas.get(winner)
        if known is None or not known.healthy:
            winner = self._shared.claim_home(conv, replica, replacing=winner)
            known = self._replicas.get(winner)
            if known is None or not known.healthy:
                return replica  # a third worker's unknown home: route here, claim next turn
        return known.id

    def _shared_home(
        self, conv: ConversationKey, home: ReplicaId | None, rehomed: bool
    ) -> tuple[ReplicaId | None, bool, ReplicaId | None]:
        """``conv``'s home as the workers share it: ``(home, rehomed, lost)``. A home on a
        replica this router holds down is lost (the turn is re-homed, replacing it); a home
        set by another worker is adopted; none (ended elsewhere, expired) forgets ours."""
        assert self._shared is not None
        found = self._shared.home(conv)
        if found == home:
            return home, rehomed, None
        if home is not None:  # ours is stale: forget it locally
            self._replicas[home].conversations.discard(conv)
            del self._homes[conv]
            self._restart.discard(conv)
        known = self._replicas.get(found) if found is not None else None
        if known is None:
            return None, False, found
        if not known.healthy:
            return None, True, found
        self._homes[conv] = known.id
        known.conversations.add(conv)
        return known.id, False, None

    # ---- internals -----------------------------------------------------------------------------

    def _holders(self, request: RouteRequest) -> list[Replica]:
        salt = request.salt
        if self._scan_all:
            return [r for r in self._healthy if r.holds_any(salt, request.keys)]
        found: set[int] = set()
        order = self._order
        for key in request.keys:
            entry = self._roots.get((salt, key))
            if not entry:
                continue
            stale: list[int] = []
            for index in entry:
                if index in found:
                    continue  # a holder already (its stale entries, if any, wait a later probe)
                planner = order[index]._planners.get(salt)  # inlined Replica.tree: hot loop
                if planner is not None and key in planner.prefix_tree.root.children:
                    found.add(index)
                elif (salt, key, index) not in self._planned:
                    stale.append(index)  # evicted, or the replica went down
            if stale:
                entry.difference_update(stale)
                if not entry:
                    del self._roots[(salt, key)]
        return [order[i] for i in found]

    def _unplanned(self, decision: RouteDecision) -> None:
        """``decision`` left flight: its first chunk's hint entry no longer waits on it."""
        plan = decision.plan
        if plan.turn != 1 or not plan.ordered:
            return
        index = self._replicas[decision.replica].index
        planned = (decision.salt, plan.ordered[0].key, index)
        left = self._planned.get(planned, 0) - 1
        if left > 0:
            self._planned[planned] = left
        else:
            self._planned.pop(planned, None)

    def _view(self) -> ClusterView:
        # One view per router, refreshed in place (assigned_total moves every request, the
        # healthy set on faults): building a dataclass per decision was a hot-path cost.
        view = self._cluster
        view.healthy = self._healthy
        view.assigned_total = self._assigned_total
        return view

    def _check_invariants(self) -> None:
        sums: dict[ReplicaId, tuple[int, int]] = {r.id: (0, 0) for r in self._order}
        for d in self._inflight.values():
            n, t = sums[d.replica]
            sums[d.replica] = (n + 1, t + d.prompt_tokens)
        for r in self._order:
            own = self._own(r)
            assert (own.requests, own.prompt_tokens) == sums[r.id], r.id
            assert r.load.work_s >= 0
            if not r.healthy:
                assert not r._planners and not r.conversations and r.load == ReplicaLoad()
            for conv in r.conversations:
                assert self._homes[conv] == r.id
            for planner in r._planners.values():
                planner.check_invariants()
        for conv, rid in self._homes.items():
            assert self._replicas[rid].healthy and conv in self._replicas[rid].conversations
        assert self._restart <= self._homes.keys()
        assert self._healthy == tuple(r for r in self._order if r.healthy)
        assert self._assigned_total == sum(r.load.assigned for r in self._healthy)
        self._loads.check()
        planned: dict[tuple[str | None, ChunkKey, int], int] = {}
        for d in self._inflight.values():
            if d.plan.turn == 1 and d.plan.ordered:
                key = (d.salt, d.plan.ordered[0].key, self._replicas[d.replica].index)
                planned[key] = planned.get(key, 0) + 1
                assert key[2] in self._roots.get(key[:2], set()), key
        assert planned == self._planned
