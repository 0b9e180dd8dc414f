"""A view of a store for one replica of a routed engine: every namespace gets a suffix.

``CraftEngine(server=[url, url], store="redis://...")`` gives each replica's engine a
:class:`ScopedStore` over the one shared store: the replica's planners (its CP-Trees, one per
cache salt) live in namespaces ``<namespace>.<scope>`` (``default.r1a2b...``,
``salt-<digest>.r1a2b...``), so every app worker's planner for that replica reads and writes
the same log, and no two replicas share one. The scope is a digest of the replica id (its URL
without credentials), so it does not depend on the order of ``server=``. A suffix, not a
prefix: a salt's namespace still starts with ``salt-``, so errors never name it.

``planner_config``: the config every worker's planners of this replica use (the routing
policy's ordering, promotion ``served``); the engine's ``store=`` planners take it instead of
their default (the store checks that all workers agree).
"""

from __future__ import annotations

import hashlib

from craft_rag.planner.plans import PlannerConfig
from craft_rag.stores import base

__all__ = ["ScopedStore", "replica_scope"]


def replica_scope(replica: str) -> str:
    """The namespace suffix of ``replica`` (its id: the server URL without credentials)."""
    return "r" + hashlib.sha256(replica.encode("utf-8")).hexdigest()[:12]


class ScopedStore(base.StateStore):
    """``inner`` with every namespace suffixed by ``.<scope>`` (see the module docstring).
    Thread-safe as ``inner``; closing the view leaves ``inner`` open (its owner closes it)."""

    def __init__(
        self, inner: base.StateStore, scope: str, planner_config: PlannerConfig | None = None
    ) -> None:
        if not scope.isalnum() or len(scope) > 16:
            msg = f"scope must be 1-16 letters and digits, got {scope!r}"
            raise ValueError(msg)
        self.inner = inner
        self.scope = scope
        self.planner_config = planner_config
        self.url = inner.url
        self.fallback = inner.fallback
        self.snapshot_every = inner.snapshot_every

    def _ns(self, namespace: str) -> str:
        base.check_namespace(namespace)
        return base.check_namespace(f"{namespace}.{self.scope}")

    def attach(self, namespace: str, fingerprint: str) -> None:
        self.inner.attach(self._ns(namespace), fingerprint)

    def _range(self, namespace: str, since: int) -> tuple[int, list[base.LogEntry]]:
        return self.inner._range(self._ns(namespace), since)

    def _append(
        self, namespace: str, request: base.AppendRequest
    ) -> tuple[int, list[base.LogEntry]]:
        return self.inner._append(self._ns(namespace), request)

    def settle(self, namespace: str, token: str) -> int:
        return self.inner.settle(self._ns(namespace), token)

    def _snapshot(self, namespace: str) -> base.Snapshot | None:
        return self.inner._snapshot(self._ns(namespace))

    def put_snapshot(self, namespace: str, snapshot: base.Snapshot, keep_from: int) -> None:
        self.inner.put_snapshot(self._ns(namespace), snapshot, keep_from)

    def put_history(
        self, namespace: str, conversation: str, version: int, data: str, ttl_s: float | None
    ) -> bool:
        return self.inner.put_history(self._ns(namespace), conversation, version, data, ttl_s)

    def get_history(self, namespace: str, conversation: str) -> base.HistoryRecord:
        return self.inner.get_history(self._ns(namespace), conversation)

    def clear(self, namespace: str) -> None:
        self.inner.clear(self._ns(namespace))

    def close(self) -> None:
        """The view only: ``inner`` stays open."""

    def __repr__(self) -> str:
        return f"ScopedStore({self.inner!r}, {self.scope!r})"
