"""The CRAFT planner: :class:`CraftPlanner` (``plan`` -> ``commit``) and its value types.

Modules: :mod:`~craft_rag.planner.planner` (:class:`CraftPlanner`), :mod:`~craft_rag.planner.plans`
(:class:`Plan`, :class:`PlannerConfig`, :class:`CommitResult`, :class:`PlannerStats`, commit
argument checks), :mod:`~craft_rag.planner.leases` (plan leases: claim, reserve, release),
:mod:`~craft_rag.planner.record` (:class:`ServedTurn` and the one path that records it),
:mod:`~craft_rag.planner.feedback` (the engine's KV events), :mod:`~craft_rag.planner.sync`
(the shared-store component a planner holds) and :mod:`~craft_rag.planner.io` (the JSON state).
Callers outside this package use the names below and the planner's public methods only.
"""

from craft_rag.planner.planner import CraftPlanner
from craft_rag.planner.plans import CommitResult, Plan, PlannerConfig, PlannerStats
from craft_rag.planner.record import ServedTurn

__all__ = ["CommitResult", "CraftPlanner", "Plan", "PlannerConfig", "PlannerStats", "ServedTurn"]
