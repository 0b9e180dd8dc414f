"""Planner state shared by many workers: ``memory://``, ``sqlite:///path``, ``redis://host/db``.

``open_store(url)`` picks the backend from the URL's scheme (:data:`STORE_SCHEMES`); pass the
store (or the URL) as ``CraftPlanner(config, store=...)`` / ``CraftEngine(store=...)``. What is
shared and how is described in :mod:`craft_rag.stores.base` and docs/deployment.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping

from craft_rag.redact import redact_url
from craft_rag.stores.base import (
    DEFAULT_SNAPSHOT_EVERY,
    STORE_FORMAT,
    ConversationConflict,
    HistoryRecord,
    LogEntry,
    LogRead,
    Snapshot,
    StateStore,
    StoreCorrupted,
    StoreError,
    StoreUnavailable,
    check_namespace,
)
from craft_rag.stores.memory_store import MemoryStore


def _sqlite(url: str) -> StateStore:
    from craft_rag.stores.sqlite_store import SQLiteStore

    return SQLiteStore.from_url(url)


def _redis(url: str) -> StateStore:
    from craft_rag.stores.redis_store import RedisStore

    return RedisStore.from_url(url)


STORE_SCHEMES: Mapping[str, Callable[[str], StateStore]] = {
    "memory": MemoryStore.from_url,
    "sqlite": _sqlite,
    "redis": _redis,
    "rediss": _redis,
}
"""URL scheme -> backend factory (the backends import lazily: ``redis`` is an extra)."""

DEFAULT_NAMESPACE = "default"


def open_store(url: str) -> StateStore:
    """The store named by ``url``. ``ValueError`` naming the supported schemes for an unknown
    scheme or a malformed URL; backends may raise :class:`StoreCorrupted` (format mismatch) or
    ``ImportError`` (client missing). Opening connects lazily (Redis) or opens the file
    (SQLite)."""
    if not isinstance(url, str) or "://" not in url:
        msg = (
            f"store must be a URL like memory://, sqlite:///path/state.db or "
            f"redis://host:6379/0, got {redact_url(url)!r}; supported schemes: "
            f"{sorted(STORE_SCHEMES)}"
        )
        raise ValueError(msg)
    scheme = url.split("://", 1)[0].lower()
    factory = STORE_SCHEMES.get(scheme)
    if factory is None:
        msg = (
            f"unknown store scheme {scheme[:20]!r} in {redact_url(url)!r}; supported: "
            f"{sorted(STORE_SCHEMES)}"
        )
        raise ValueError(msg)
    return factory(url)


def as_store(store: StateStore | str) -> StateStore:
    """``store`` itself, or the store its URL names (see :func:`open_store`)."""
    if isinstance(store, StateStore):
        return store
    return open_store(store)


def namespace_for_salt(cache_salt: str | None) -> str:
    """The store namespace of a tenant's ``cache_salt`` (``"default"`` for none): a digest, so
    no tenant id appears in the store and no two salts share a namespace."""
    if cache_salt is None:
        return DEFAULT_NAMESPACE
    return "salt-" + hashlib.sha256(cache_salt.encode("utf-8")).hexdigest()[:32]


__all__ = [
    "DEFAULT_NAMESPACE",
    "DEFAULT_SNAPSHOT_EVERY",
    "STORE_FORMAT",
    "STORE_SCHEMES",
    "ConversationConflict",
    "HistoryRecord",
    "LogEntry",
    "LogRead",
    "MemoryStore",
    "Snapshot",
    "StateStore",
    "StoreCorrupted",
    "StoreError",
    "StoreUnavailable",
    "as_store",
    "check_namespace",
    "namespace_for_salt",
    "open_store",
]
