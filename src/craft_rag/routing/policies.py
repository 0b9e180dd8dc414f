"""Routing policies: which healthy replica serves a new request (paper §4.2 leaves this open).

Each policy is a tiny object with ``choose(request, view) -> Candidate`` looked up by name in
:data:`ROUTING_POLICIES`, like the ordering policies. ``ordering`` names the chunk-ordering
policy the replicas' planners use under it. Policies read state and change nothing but their
own cursor (``round_robin``).

The two KV-aware policies share one cost, in predicted seconds of waiting plus prefill
(the form of Dynamo's ``overlap_weight * prefill_blocks + decode_blocks``, with our fitted
TTFT model instead of block counts and no decode term, since TTFT here is prefill-bound)::

    cost(r) = ttft_model.predict(uncached_r, cached_r) + load_weight * work_s(r)

where ``cached_r`` is the predicted cached prefix on replica ``r`` (whole blocks, at most
``prompt_tokens - 1``) and ``work_s(r)`` the predicted prefill seconds already in flight there.
A hot prefix cannot pile onto one replica: ``r`` is a candidate only while
``assigned(r) < balance_slack * (assigned_total + 1) / healthy + balance_headroom``
(see :meth:`ClusterView.assign_bound`). Only replicas whose tree holds one of the request's
chunks at its root are evaluated (the router keeps a root-key -> replicas hint index, checked
against the trees on use), plus the least-loaded admissible replica, so a decision costs one
O(N) scan of loads plus a few set matches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from craft_rag.chunk import Chunk
from craft_rag.prefix_tree import ChunkPrefixTree, PrefixMatch
from craft_rag.routing.queueing import TTFTModel
from craft_rag.routing.replica import Replica
from craft_rag.types import ChunkKey, ConversationId


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One request to place. ``keys``: distinct chunk keys in retriever order;
    ``prompt_tokens``: the prompt's length (order does not change it)."""

    chunks: tuple[Chunk, ...]
    keys: tuple[ChunkKey, ...]
    prompt_tokens: int
    conversation_id: ConversationId | None = None
    salt: str | None = None


@dataclass(frozen=True, slots=True)
class Candidate:
    """A replica with its predicted cached prompt tokens and cost (predicted seconds)."""

    replica: Replica
    predicted_cached_tokens: int
    cost_s: float


@dataclass(frozen=True, slots=True)
class ClusterView:
    """What a policy may read: the healthy replicas (in index order) and the cost settings."""

    healthy: Sequence[Replica]
    holders: Callable[[RouteRequest], Sequence[Replica]]
    """Healthy replicas whose tree for the request's salt has one of its keys at the root
    (only these can have a non-empty match), in index order."""
    assigned_total: int
    ttft_model: TTFTModel
    load_weight: float
    balance_slack: float
    balance_headroom: int
    block_size: int

    def assign_bound(self) -> float:
        """A replica with ``assigned >= bound`` takes no new request (except its own
        conversations' turns). Always admits the least-assigned replica. O(1)."""
        mean = (self.assigned_total + 1) / len(self.healthy)
        return self.balance_slack * mean + self.balance_headroom

    def cached_tokens(self, match: PrefixMatch, request: RouteRequest) -> int:
        """Predicted cached tokens of a prompt whose first ``match.length`` chunks are cached:
        whole blocks only and never the last prompt token (as vLLM). Spans unknown -> the
        matched share of the prompt. O(1)."""
        if not match.nodes:
            return 0
        tokens = match.tokens
        if tokens is None:
            tokens = request.prompt_tokens * match.length // max(1, len(request.keys))
        tokens = min(tokens, request.prompt_tokens - 1)
        return max(0, tokens // self.block_size * self.block_size)

    def candidate(self, replica: Replica, request: RouteRequest, cached: int) -> Candidate:
        uncached = request.prompt_tokens - cached
        cost = self.ttft_model.predict(uncached, cached) + self.load_weight * replica.load.work_s
        return Candidate(replica, cached, cost)

    def least_loaded(self, bound: float | None = None) -> Replica:
        """The admissible replica with the least in-flight work, then fewest assigned, then
        lowest index. O(N)."""
        best: Replica | None = None
        for r in self.healthy:
            if bound is not None and r.load.assigned >= bound:
                continue
            if best is None or (r.load.work_s, r.load.assigned) < (
                best.load.work_s,
                best.load.assigned,
            ):
                best = r
        assert best is not None, "the least-assigned replica is always admissible"
        return best


class RoutingPolicy(Protocol):
    name: str
    ordering: str

    def choose(self, request: RouteRequest, view: ClusterView) -> Candidate:
        """The replica to serve ``request`` (``view.healthy`` is never empty)."""
        ...


class RoundRobin:
    """The paper's deployment: replicas in turn, CRAFT ``tree`` order on each. O(1)."""

    name = "round_robin"
    ordering = "tree"

    def __init__(self) -> None:
        self._next = 0  # owner: this policy object

    def choose(self, request: RouteRequest, view: ClusterView) -> Candidate:
        replica = view.healthy[self._next % len(view.healthy)]
        self._next = (self._next + 1) % len(view.healthy)
        return _with_tree_prediction(replica, request, view)


class LeastLoaded:
    """Least in-flight predicted prefill seconds (ties: fewest assigned, lowest index); CRAFT
    ``tree`` order on each replica. O(N)."""

    name = "least_loaded"
    ordering = "tree"

    def choose(self, request: RouteRequest, view: ClusterView) -> Candidate:
        return _with_tree_prediction(view.least_loaded(), request, view)


def _with_tree_prediction(replica: Replica, request: RouteRequest, view: ClusterView) -> Candidate:
    tree = replica.tree(request.salt)
    match = tree.match_subset(request.keys) if tree is not None else PrefixMatch(())
    return view.candidate(replica, request, view.cached_tokens(match, request))


class _KVAware:
    """Shared cost-based choice; subclasses say how a replica's tree matches the request."""

    name = ""
    ordering = ""

    def match(self, tree: ChunkPrefixTree, request: RouteRequest) -> PrefixMatch:
        raise NotImplementedError

    def choose(self, request: RouteRequest, view: ClusterView) -> Candidate:
        bound = view.assign_bound()
        best = view.candidate(view.least_loaded(bound), request, 0)
        for replica in view.holders(request):
            if replica.load.assigned >= bound:
                continue
            tree = replica.tree(request.salt)
            assert tree is not None
            cached = view.cached_tokens(self.match(tree, request), request)
            if cached == 0:
                continue
            option = view.candidate(replica, request, cached)
            if option.cost_s < best.cost_s or (
                option.cost_s == best.cost_s and replica.index < best.replica.index
            ):
                best = option
        return best


class PrefixFixedOrder(_KVAware):
    """llm-d / Dynamo style: the prompt keeps the retriever order and goes where its longest
    cached *prefix* is (same cost and bound as ``craft_joint``, so only the order differs)."""

    name = "prefix_fixed_order"
    ordering = "retriever"

    def match(self, tree: ChunkPrefixTree, request: RouteRequest) -> PrefixMatch:
        return tree.match(request.keys)


class CraftJoint(_KVAware):
    """Ours: for each replica the best order is its CP-Tree's longest path inside the request's
    chunk *set* (the ``tree`` ordering policy's set match), and the replica is chosen on the
    cached prefix that order gets there."""

    name = "craft_joint"
    ordering = "tree"

    def match(self, tree: ChunkPrefixTree, request: RouteRequest) -> PrefixMatch:
        return tree.match_subset(request.keys)


ROUTING_POLICIES: Mapping[str, Callable[[], RoutingPolicy]] = {
    RoundRobin.name: RoundRobin,
    LeastLoaded.name: LeastLoaded,
    PrefixFixedOrder.name: PrefixFixedOrder,
    CraftJoint.name: CraftJoint,
}

DEFAULT_ROUTING_POLICY = "craft_joint"


def get_routing_policy(name: str) -> RoutingPolicy:
    """A new policy object by name; ``ValueError`` lists the valid names."""
    try:
        return ROUTING_POLICIES[name]()
    except (KeyError, TypeError):
        msg = f"unknown routing policy {name!r}; choose one of {sorted(ROUTING_POLICIES)}"
        raise ValueError(msg) from None
