"""Moved to craft_rag.planner.io; alias kept for one release."""

from craft_rag.planner.io import (
    FORMAT,
    PlannerFiles,
    PlannerState,
    read_state_file,
    state_from_json,
)

__all__ = ["FORMAT", "PlannerFiles", "PlannerState", "read_state_file", "state_from_json"]
