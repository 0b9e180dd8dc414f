"""KV-aware routing across vLLM replicas: joint placement and chunk order.

:class:`Router` places each request on a replica and plans its order against that replica's
CP-Tree; :mod:`craft_rag.routing.simulator` replays traces through N simulated replicas.
"""

from craft_rag.routing.policies import (
    DEFAULT_ROUTING_POLICY,
    ROUTING_POLICIES,
    Candidate,
    ClusterView,
    RouteRequest,
    RoutingPolicy,
    get_routing_policy,
)
from craft_rag.routing.queueing import (
    DEFAULT_TTFT_MODEL,
    TTFTModel,
    TTFTPoint,
    fit_ttft_model,
)
from craft_rag.routing.replica import Replica, ReplicaId, ReplicaLoad
from craft_rag.routing.router import (
    FaultReport,
    RouteDecision,
    Router,
    RouterConfig,
    RouterStats,
)
from craft_rag.routing.tier_costs import DISK_MEDIUM, RAM_MEDIUM, TierCosts

__all__ = [
    "DEFAULT_ROUTING_POLICY",
    "DEFAULT_TTFT_MODEL",
    "DISK_MEDIUM",
    "RAM_MEDIUM",
    "ROUTING_POLICIES",
    "Candidate",
    "ClusterView",
    "FaultReport",
    "Replica",
    "ReplicaId",
    "ReplicaLoad",
    "RouteDecision",
    "RouteRequest",
    "Router",
    "RouterConfig",
    "RouterStats",
    "RoutingPolicy",
    "TTFTModel",
    "TTFTPoint",
    "TierCosts",
    "fit_ttft_model",
    "get_routing_policy",
]
