"""Moved to craft_rag.planner.leases; alias kept for one release."""

from craft_rag.planner.leases import LeaseDesk, PlanLease, PlanLeases, fingerprint

__all__ = ["LeaseDesk", "PlanLease", "PlanLeases", "fingerprint"]
