"""The router's value types: its settings (:class:`RouterConfig`), a placement
(:class:`RouteDecision`), what a replica's loss did (:class:`FaultReport`) and its totals
(:class:`RouterStats`). Kept apart from :mod:`craft_rag.routing.router` so that module is the
routing logic alone; every name stays importable from there."""

from __future__ import annotations

from dataclasses import dataclass, field

from craft_rag.planner import Plan, PlannerConfig
from craft_rag.routing.queueing import DEFAULT_TTFT_MODEL, TTFTModel
from craft_rag.routing.replica import ReplicaId
from craft_rag.routing.tier_costs import DEFAULT_TIER_COSTS, TierCosts
from craft_rag.types import ConversationId
from craft_rag.validation import check_int, check_number

__all__ = ["FaultReport", "RouteDecision", "RouterConfig", "RouterStats"]


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Cost and bound parameters (see :mod:`craft_rag.routing.policies`).

    ``load_weight``: weight of in-flight predicted prefill seconds in the cost (1 = the cost is
    the predicted TTFT under FIFO prefill). ``balance_slack``/``balance_headroom``: the
    assignment bound ``slack * mean + headroom``; the run's max/mean assigned requests then stays
    below ``slack + (headroom + 1) * N / requests`` (later conversation turns are exempt).
    ``planner``: settings of every replica planner (its ``policy`` is replaced by the routing
    policy's ordering, promotion is ``served``: a replica caches every order it serves).
    ``tier_costs``: load-over-compute ratios of a cached token a replica holds only in its RAM
    or disk KV tier (:class:`~craft_rag.routing.tier_costs.TierCosts`; defaults measured on
    this engine).
    """

    load_weight: float = 1.0
    balance_slack: float = 1.15
    balance_headroom: int = 2
    block_size: int = 32
    ttft_model: TTFTModel = DEFAULT_TTFT_MODEL
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    tier_costs: TierCosts = DEFAULT_TIER_COSTS

    def __post_init__(self) -> None:
        if not isinstance(self.tier_costs, TierCosts):
            msg = (
                "tier_costs: must be a craft_rag.routing.TierCosts, "
                f"got {type(self.tier_costs).__name__}"
            )
            raise ValueError(msg)
        check_number(self.load_weight, "load_weight", minimum=0.0)
        check_number(self.balance_slack, "balance_slack (1.0 = perfectly even)", minimum=1.0)
        check_int(self.balance_headroom, "balance_headroom", minimum=1)  # not True, int64
        check_int(self.block_size, "block_size (the engines' block size)", minimum=1)


@dataclass(slots=True, eq=False)
class RouteDecision:
    """Where one request goes and in which order. ``sticky``: a later turn sent to its
    conversation's home; ``rehomed``: that home was lost, so this is the conversation's first
    turn here (a first turn unless its engine carried the history over: nothing of it cached).
    ``predicted_cost_s``: the policy's cost (predicted TTFT plus weighted queue).

    A read-only record: the router never changes one it returned, and callers must not (it is
    not ``frozen`` because a frozen dataclass's ``__init__`` costs ~5x more, ~3 µs for these
    fields, on every decision). Equality and hash are identity (``decision_id`` is unique per
    router)."""

    decision_id: int
    replica: ReplicaId
    plan: Plan
    salt: str | None = field(repr=False)  # a tenant's key: never shown
    prompt_tokens: int
    predicted_cached_tokens: int
    predicted_work_s: float
    predicted_cost_s: float
    sticky: bool
    rehomed: bool
    epoch: int
    plan_ns: int = 0
    """Wall nanoseconds spent in the replica planner's ``plan()`` (the ordering every policy
    pays, single replica included); the rest of ``route()`` is the placement decision."""


@dataclass(frozen=True, slots=True)
class FaultReport:
    """What :meth:`Router.mark_down` did: tree nodes dropped, requests still in flight there
    (lost), and each re-homed conversation with its new home (None: no healthy replica). A
    conversation id appears once per tenant (salt) that had it there; salts are not shown."""

    replica: ReplicaId
    nodes_dropped: int
    inflight_lost: int
    rehomed: tuple[tuple[ConversationId, ReplicaId | None], ...]


@dataclass(slots=True)
class RouterStats:
    """Totals since creation. Owner: :class:`Router`."""

    decisions: int = 0
    sticky: int = 0
    rehomed_turns: int = 0
    faults: int = 0
