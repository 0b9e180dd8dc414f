"""Moved to craft_rag.planner.sync (now a component); alias kept for one release."""

from craft_rag.planner.sync import PlannerHost, SharedSync

__all__ = ["PlannerHost", "SharedSync"]
