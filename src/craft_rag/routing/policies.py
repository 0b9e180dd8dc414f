"""Routing policies: which healthy replica serves a new request (paper §4.2 leaves this open).

Each policy is a tiny object with ``choose(request, view) -> Candidate`` looked up by name in
:data:`ROUTING_POLICIES`, like the ordering policies. ``ordering`` names the chunk-ordering
policy the replicas' planners use under it. Policies read state and change nothing but their
own cursor (``round_robin``).

``prefix_craft_order`` (:class:`PrefixCraftOrder`) models an existing serving layer (llm-d,
Dynamo) fed prompts the application ordered with CRAFT, scoring in Dynamo's KV blocks;
``prefix_blocks`` is the same layer fed retriever-ordered prompts (its users today). The
other two KV-aware policies share one cost, in predicted seconds of waiting plus prefill
(the form of Dynamo's ``overlap_weight * prefill_blocks + decode_blocks``, with our fitted
TTFT model instead of block counts and no decode term, since TTFT here is prefill-bound)::

    cost(r) = ttft_model.predict(uncached_r, cached_r) + load_weight * work_s(r)

where ``cached_r`` is the predicted cached prefix on replica ``r`` (whole blocks, at most
``prompt_tokens - 1``) and ``work_s(r)`` the predicted prefill seconds already in flight there.
Cached tokens that ``r`` holds only in a KV tier (RAM or disk) add ``(b - c) * ratio(tier)``
each, the load time (:mod:`craft_rag.routing.tier_costs`); a tree without tier-only nodes adds
nothing, so its decisions are exactly those made before tiers were modelled.
A hot prefix cannot pile onto one replica: ``r`` is a candidate only while
``assigned(r) < balance_slack * (assigned_total + 1) / healthy + balance_headroom``
(see :meth:`ClusterView.assign_bound`). Only replicas whose tree holds one of the request's
chunks at its root are evaluated (the router keeps a root-key -> replicas hint index, checked
against the trees on use), plus the least-loaded admissible replica (from the router's
:class:`~craft_rag.routing.load_index.LoadIndex`, O(log N)), so a decision costs the hint
probes plus a few set matches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from craft_rag.chunk import Chunk
from craft_rag.prefix_tree import ChunkPrefixTree, PrefixMatch, PrefixNode
from craft_rag.routing.load_index import LoadIndex
from craft_rag.routing.matching import fixed_match_end, set_match_end
from craft_rag.routing.queueing import TTFTModel
from craft_rag.routing.replica import Replica
from craft_rag.routing.tier_costs import DEFAULT_TIER_COSTS, TierCosts, tier_penalty
from craft_rag.types import ChunkKey, ConversationId
from craft_rag.validation import from_registry, registry_by_name


@dataclass(slots=True)
class RouteRequest:
    """One request to place. ``keys``: distinct chunk keys in retriever order;
    ``prompt_tokens``: the prompt's length (order does not change it). A read-only value
    (not ``frozen``: a frozen dataclass's ``__init__`` costs ~5x more, and one is built per
    decision on the router's hot path); policies never change it."""

    chunks: tuple[Chunk, ...]
    keys: tuple[ChunkKey, ...]
    prompt_tokens: int
    conversation_id: ConversationId | None = None
    salt: str | None = field(default=None, repr=False)  # a tenant's key: never shown
    key_set: frozenset[ChunkKey] = frozenset()
    """``frozenset(keys)``, built once per request for the set matches (filled when empty)."""

    def __post_init__(self) -> None:
        if not self.key_set and self.keys:
            self.key_set = frozenset(self.keys)


@dataclass(slots=True)
class Candidate:
    """A replica with its predicted cached prompt tokens and cost (predicted seconds).
    Read-only by convention (not frozen: it is built on the hot path)."""

    replica: Replica
    predicted_cached_tokens: int
    cost_s: float
    tier_s: float = 0.0
    """Predicted seconds of loading the tier-only part of the cached prefix, over reading it
    from the pool (in ``cost_s``; 0.0 when the replica's pool holds all of it)."""


@dataclass(slots=True)
class ClusterView:
    """What a policy may read: the healthy replicas (in index order) and the cost settings.

    Owner: the :class:`~craft_rag.routing.Router`, which keeps one view and refreshes
    ``healthy`` and ``assigned_total`` in place where they change (building a view per
    decision cost more than the rest of a cold placement); policies only read it."""

    healthy: Sequence[Replica]
    holders: Callable[[RouteRequest], Sequence[Replica]]
    """Healthy replicas whose tree for the request's salt has one of its keys at the root
    (only these can have a non-empty match), each once, in no particular order (the choice
    breaks ties by index itself)."""
    assigned_total: int
    ttft_model: TTFTModel
    load_weight: float
    balance_slack: float
    balance_headroom: int
    block_size: int
    load_index: LoadIndex | None = None
    """The router's least-loaded index (same answer as :meth:`scan_least_loaded`, O(log N));
    None: scan."""
    tier_costs: TierCosts = DEFAULT_TIER_COSTS
    """Load-over-compute ratio of a token held only in a KV tier."""

    def assign_bound(self) -> float:
        """A replica with ``assigned >= bound`` takes no new request (except its own
        conversations' turns). Always admits the least-assigned replica. O(1)."""
        mean = (self.assigned_total + 1) / len(self.healthy)
        return self.balance_slack * mean + self.balance_headroom

    def cached_tokens(self, match: PrefixMatch, request: RouteRequest) -> int:
        """Predicted cached tokens of a prompt whose first ``match.length`` chunks are cached:
        whole blocks only and never the last prompt token (as vLLM). Spans unknown -> the
        matched share of the prompt. O(1)."""
        return self.cached_tokens_at(match.nodes[-1] if match.nodes else None, request)

    def cached_tokens_at(self, end: PrefixNode | None, request: RouteRequest) -> int:
        """:meth:`cached_tokens` of the match ending at node ``end`` (None: empty). O(1)."""
        if end is None:
            return 0
        tokens = end.token_end
        if tokens is None:
            tokens = request.prompt_tokens * end.depth // max(1, len(request.keys))
        tokens = min(tokens, request.prompt_tokens - 1)
        return max(0, tokens // self.block_size * self.block_size)

    def candidate(
        self, replica: Replica, request: RouteRequest, cached: int, end: PrefixNode | None = None
    ) -> Candidate:
        """``replica``'s cost with ``cached`` tokens cached along the path ending at ``end``
        (None: no path known, all of ``cached`` in the pool). O(depth of ``end``)."""
        uncached = request.prompt_tokens - cached
        model = self.ttft_model
        cost = model.predict(uncached, cached) + self.load_weight * replica.load.work_s
        penalty = tier_penalty(end, cached, self.tier_costs)
        if not penalty:  # nothing tier-only: today's cost, bit for bit
            return Candidate(replica, cached, cost)
        tier_s = (model.b - model.c) * penalty
        return Candidate(replica, cached, cost + tier_s, tier_s)

    def least_loaded(self, bound: float | None = None) -> Replica:
        """The admissible replica (``assigned < bound``) with the least in-flight work, then
        fewest assigned, then lowest index: :meth:`scan_least_loaded`'s answer, from the
        router's load index when there is one (O(log N)), else by that scan (O(N))."""
        if self.load_index is not None:
            found = self.load_index.least(float("inf") if bound is None else bound)
            assert found is not None, "the least-assigned replica is always admissible"
            return found
        return self.scan_least_loaded(bound)

    def scan_least_loaded(self, bound: float | None = None) -> Replica:
        """The rule of :meth:`least_loaded`, by scanning every healthy replica. O(N)."""
        best: Replica | None = None
        best_work, best_assigned = float("inf"), 0
        limit = float("inf") if bound is None else bound
        for r in self.healthy:
            load = r.load
            assigned = load.assigned
            if assigned >= limit:
                continue
            work = load.work_s
            if work < best_work or (work == best_work and assigned < best_assigned):
                best, best_work, best_assigned = r, work, assigned
        assert best is not None, "the least-assigned replica is always admissible"
        return best


class RoutingPolicy(Protocol):
    name: str
    ordering: str
    app_ordering: str | None
    """The ordering policy of the *application's* planner, which orders each prompt before it
    reaches the router (the replicas' planners then keep that order); None: the chunks reach
    the router in retriever order and the replica's planner orders them."""

    def choose(self, request: RouteRequest, view: ClusterView) -> Candidate:
        """The replica to serve ``request`` (``view.healthy`` is never empty)."""
        ...


class RoundRobin:
    """The paper's deployment: replicas in turn, CRAFT ``tree`` order on each. O(1)."""

    name = "round_robin"
    ordering = "tree"
    app_ordering: str | None = None

    def __init__(self) -> None:
        self._next = 0  # owner: this policy object

    def choose(self, request: RouteRequest, view: ClusterView) -> Candidate:
        replica = view.healthy[self._next % len(view.healthy)]
        self._next = (self._next + 1) % len(view.healthy)
        return _with_tree_prediction(replica, request, view)


class LeastLoaded:
    """Least in-flight predicted prefill seconds (ties: fewest assigned, lowest index); CRAFT
    ``tree`` order on each replica. O(log N) (the router's load index)."""

    name = "least_loaded"
    ordering = "tree"
    app_ordering: str | None = None

    def choose(self, request: RouteRequest, view: ClusterView) -> Candidate:
        return _with_tree_prediction(view.least_loaded(), request, view)


def _with_tree_prediction(replica: Replica, request: RouteRequest, view: ClusterView) -> Candidate:
    tree = replica.tree(request.salt)
    end = set_match_end(tree, request.key_set) if tree is not None else None
    return view.candidate(replica, request, view.cached_tokens_at(end, request), end)


class _KVAware:
    """Shared cost-based choice; subclasses say how a replica's tree matches the request.

    The choice is the least ``(cost, index)`` over the least-loaded admissible replica (with
    nothing cached) and every admissible holder (with its match). Holders are visited by
    increasing in-flight work, and the walk stops at the first whose cost *with the best
    conceivable match* (all of the prompt but its last token cached) already loses: every later
    one has at least as much work, so it loses too. Only trees that can still win are matched;
    the result is the exhaustive minimum (tested against it on random trees and loads). A
    tier-only part of a match only adds cost (ratios are >= 0), so that bound stays a bound.
    """

    name = ""
    ordering = ""
    app_ordering: str | None = None

    def match_end(self, tree: ChunkPrefixTree, request: RouteRequest) -> PrefixNode | None:
        raise NotImplementedError

    def match(self, tree: ChunkPrefixTree, request: RouteRequest) -> PrefixMatch:
        raise NotImplementedError

    def choose(self, request: RouteRequest, view: ClusterView) -> Candidate:
        bound = view.assign_bound()
        best = view.least_loaded(bound)
        best_cached, best_index, best_tier = 0, best.index, 0.0
        model, weight, prompt = view.ttft_model, view.load_weight, request.prompt_tokens
        best_cost = model.predict(prompt, 0) + weight * best.load.work_s
        holders = view.holders(request)
        # The cheapest any holder can be with w in-flight work is floor + weight * w (cost
        # falls as cached tokens rise, when b > c). Pruning needs that order; without it
        # (b <= c: caching does not pay) every holder is matched.
        top = (prompt - 1) // view.block_size * view.block_size
        prune = model.b > model.c
        if prune:
            if top <= 0:
                return Candidate(best, 0, best_cost)
            floor = model.predict(prompt - top, top)
            if len(holders) > 1:
                holders = sorted(holders, key=_by_work)
        salt, match_end, cached_at = request.salt, self.match_end, view.cached_tokens_at
        a, b, c = model.a, model.b, model.c  # model.predict inlined: this loop is the hot path
        costs = view.tier_costs
        for replica in holders:
            load = replica.load
            if load.assigned >= bound:
                continue
            extra = weight * load.work_s
            if prune and floor + extra - best_cost > _MARGIN * (1.0 + abs(best_cost)):
                break  # cannot win, nor can any later (more work) holder
            tree = replica.tree(salt)
            assert tree is not None
            end = match_end(tree, request)
            cached = cached_at(end, request)
            if cached == 0:
                continue
            cost = a + b * (prompt - cached) + c * cached + extra
            penalty = tier_penalty(end, cached, costs)
            tier_s = (b - c) * penalty if penalty else 0.0
            if tier_s:  # added only when non-zero: without tier data, today's cost bit for bit
                cost += tier_s
            if cost < best_cost or (cost == best_cost and replica.index < best_index):
                best, best_cached, best_index, best_cost = replica, cached, replica.index, cost
                best_tier = tier_s
        return Candidate(best, best_cached, best_cost, best_tier)


_MARGIN = 1e-9
"""Relative slack of the pruning test, far above float rounding (~1e-16): a holder is skipped
only when it loses by more than this, so pruning never changes a choice."""


def _by_work(replica: Replica) -> tuple[float, int]:
    return (replica.load.work_s, replica.index)


class PrefixFixedOrder(_KVAware):
    """llm-d / Dynamo style: the prompt keeps the retriever order and goes where its longest
    cached *prefix* is (same cost and bound as ``craft_joint``, so only the order differs)."""

    name = "prefix_fixed_order"
    ordering = "retriever"

    def match_end(self, tree: ChunkPrefixTree, request: RouteRequest) -> PrefixNode | None:
        return fixed_match_end(tree, request.keys)

    def match(self, tree: ChunkPrefixTree, request: RouteRequest) -> PrefixMatch:
        return tree.match(request.keys)


class CraftJoint(_KVAware):
    """Ours: for each replica the best order is its CP-Tree's longest path inside the request's
    chunk *set* (the ``tree`` ordering policy's set match), and the replica is chosen on the
    cached prefix that order gets there."""

    name = "craft_joint"
    ordering = "tree"

    def match_end(self, tree: ChunkPrefixTree, request: RouteRequest) -> PrefixNode | None:
        return set_match_end(tree, request.key_set)

    def match(self, tree: ChunkPrefixTree, request: RouteRequest) -> PrefixMatch:
        return tree.match_subset(request.key_set)


class PrefixCraftOrder:
    """What an llm-d / Dynamo user gets by adding only craft-rag's reorder step: the
    application's planner (one per app, not per replica: it does not know where a prompt
    goes) orders the chunks with CRAFT ``tree``, and the serving layer's router places the
    prompt *as given* by its longest exact cached prefix plus its load, the way Dynamo's KV
    router scores workers, in KV blocks::

        cost(r) = overlap_weight * (prompt_blocks - overlap_blocks(r)) + active_blocks(r)

    ``overlap_blocks(r)``: whole blocks of the prompt's cached prefix on ``r`` (the fixed-order
    match, at most ``prompt_tokens - 1`` tokens); ``active_blocks(r)``: blocks of the prompts in
    flight there (the simulator models prefill only, so every in-flight request is still in
    prefill; Dynamo's "potential decode blocks" less the new request's own, which is the same
    on every replica); ``overlap_weight = 1`` (Dynamo's default ``--kv-overlap-score-weight``).
    No assignment bound: neither system's score has one (Dynamo's optional busy threshold
    aside). Least cost wins (Dynamo at temperature 0); exact ties go to the fewest assigned,
    then the lowest index (our deterministic rule). The candidate's ``cost_s`` is still the
    TTFT-model cost, so decisions report predicted seconds like every policy. O(N) per
    decision plus one fixed-order match per replica holding one of the request's chunks at
    its root."""

    name = "prefix_craft_order"
    ordering = "retriever"
    app_ordering: str | None = "tree"
    overlap_weight = 1.0

    def choose(self, request: RouteRequest, view: ClusterView) -> Candidate:
        block = view.block_size
        prompt_blocks = request.prompt_tokens / block
        holders = {r.index for r in view.holders(request)} if request.keys else set()
        best: Replica | None = None
        best_key = (float("inf"), 0, 0)
        best_cached, best_end = 0, None
        for replica in view.healthy:
            end = None
            if replica.index in holders:
                tree = replica.tree(request.salt)
                assert tree is not None
                end = fixed_match_end(tree, request.keys)
            cached = view.cached_tokens_at(end, request)
            load = replica.load
            cost = self.overlap_weight * (prompt_blocks - cached // block) + (
                load.prompt_tokens / block
            )
            key = (cost, load.assigned, replica.index)
            if key < best_key:
                best, best_key, best_cached, best_end = replica, key, cached, end
        assert best is not None, "view.healthy is never empty"
        return view.candidate(best, request, best_cached, best_end)


class PrefixBlocks(PrefixCraftOrder):
    """:class:`PrefixCraftOrder`'s scoring on the retriever order: what an llm-d / Dynamo user
    has without craft-rag, the baseline that isolates the gain of the reorder step alone."""

    name = "prefix_blocks"
    app_ordering: str | None = None


ROUTING_POLICIES: Mapping[str, Callable[[], RoutingPolicy]] = registry_by_name(
    RoundRobin, LeastLoaded, PrefixFixedOrder, CraftJoint, PrefixBlocks, PrefixCraftOrder
)

DEFAULT_ROUTING_POLICY = "craft_joint"


def get_routing_policy(name: str) -> RoutingPolicy:
    """A new policy object by name; ``ValueError`` lists the valid names."""
    return from_registry(ROUTING_POLICIES, name, "routing policy")
