"""Moved to craft_rag.planner.record (one record(ServedTurn) path); alias kept for one release."""

from craft_rag.planner.record import Applied, ServedTurn, StateRecorder, commit_turn

__all__ = ["Applied", "ServedTurn", "StateRecorder", "commit_turn"]
