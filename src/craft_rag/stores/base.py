"""The store interface: an append-only commit log per namespace, conversation leases, snapshots.

A store keeps, for each namespace (one planner's state: one tenant / cache salt):

- a **commit log**: every committed plan as one JSON entry with a sequence number ``seq``
  (1, 2, 3... without gaps), assigned atomically by the store. Every planner attached to the
  namespace applies the entries it has not seen, in ``seq`` order, to its own CA-Table, CP-Tree
  and conversation registry, so all of them hold the state one planner would hold had it served
  every request itself (deterministic replay);
- a **conversation record** per conversation: the ``seq`` of its last committed turn (with the
  conversation TTL where the backend has one). ``append`` refuses a turn planned before another
  worker committed a turn of the same conversation (:class:`ConversationConflict`): a chat's
  dedup and its append-only prompt never fork;
- a **prompt history** per conversation (:mod:`craft_rag.stores.histories`): the token ids of
  its stored turns, written by the worker that committed its last turn, stamped with a
  ``version`` (a seq) and expiring with the conversation record, so a turn served by another
  worker renders the same append-only prompt;
- a **snapshot**: the state at some ``seq``; the log before it is trimmed (bounded log, see
  :data:`DEFAULT_SNAPSHOT_EVERY`). A reader that fell behind the trim point loads the snapshot,
  then the tail;
- a **format key** for the whole store and a **fingerprint** (the planner config) per
  namespace: a store written by another format or config is refused with a clear error, never
  silently reset.

Backends (:mod:`memory_store`, :mod:`sqlite_store`, :mod:`redis_store`) implement four
primitives; the gap/snapshot logic lives here once.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import parse_qsl

from craft_rag.redact import redact_url

STORE_FORMAT = "craft-rag/store/v1"
DEFAULT_SNAPSHOT_EVERY = 10_000
"""A snapshot is written every this many commits; the log then keeps the entries after the
previous snapshot, so it holds between ``snapshot_every`` and ``2 * snapshot_every`` entries."""

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class StoreError(Exception):
    """Base of the store errors (never raised itself)."""


class StoreUnavailable(ConnectionError, StoreError):
    """The store cannot be reached (Redis down, SQLite file locked too long)."""


class StoreCorrupted(ValueError, StoreError):
    """The store holds data this version cannot read or that contradicts the workers' state."""


class ConversationConflict(RuntimeError, StoreError):
    """Another worker committed a turn of this conversation after this turn was planned."""


class CommitVoided(RuntimeError, StoreError):
    """An append carrying a token that :meth:`StateStore.settle` declared never written."""


TOKEN_VOID_TTL_S = 86_400.0
"""How long a voided append token stays refused (a request delayed longer than this could
still land; far beyond any client timeout)."""


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One committed plan (``data`` is its JSON text, decoded by :mod:`craft_rag.stores.shared`)."""

    seq: int
    data: str


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A namespace's planner state after applying every entry up to ``seq``."""

    seq: int
    state: str


@dataclass(frozen=True, slots=True)
class HistoryRecord:
    """What the store holds for one conversation: ``last_seq``, its record's last seq (0: none
    or expired); ``version`` and ``data``, its prompt history as last written (0 and None when
    none was written or it expired)."""

    last_seq: int
    version: int = 0
    data: str | None = None


@dataclass(frozen=True, slots=True)
class AppendRequest:
    """One :meth:`StateStore.append` as the backends' ``_append`` primitive gets it (the one
    place its fields are listed): add ``data``; return the entries after ``since``; refuse
    when ``conversation``'s last commit is after ``not_after`` (no check when None) or when
    ``token`` was voided; the conversation record expires after ``ttl_s`` (None: never)."""

    data: str
    since: int
    conversation: str | None = None
    not_after: int | None = None
    ttl_s: float | None = None
    token: str | None = None

    def expiry(self, now: float) -> float | None:
        """When a conversation record written at ``now`` expires (None: never)."""
        return now + self.ttl_s if self.ttl_s is not None else None

    def check_last(self, last: int) -> None:
        """:class:`ConversationConflict` when ``conversation``'s last commit ``last`` (0:
        none or expired) is after ``not_after``."""
        if self.not_after is not None and last > self.not_after:
            raise self.conflict(last)

    def conflict(self, last: int) -> ConversationConflict:
        """The error for a conversation whose last commit ``last`` is after ``not_after``."""
        assert self.conversation is not None and self.not_after is not None
        return ConversationConflict(conflict_message(self.conversation, last, self.not_after))

    def voided(self) -> CommitVoided:
        """The error for an append whose ``token`` :meth:`StateStore.settle` voided."""
        return CommitVoided(f"append {self.token!r} was settled as not written")


@dataclass(frozen=True, slots=True)
class LogRead:
    """What a reader at ``since`` must apply: the ``snapshot`` first when the entries right
    after ``since`` were trimmed, then ``entries`` (contiguous, ascending). ``head`` is the
    store's latest seq when read."""

    head: int
    entries: tuple[LogEntry, ...]
    snapshot: Snapshot | None = None


def check_namespace(namespace: str) -> str:
    """``namespace`` if it is 1-64 characters of ``[A-Za-z0-9._-]``, else ``ValueError``."""
    if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
        msg = (
            f"store namespace must be 1-64 characters of letters, digits, '.', '_' or '-', "
            f"got {namespace!r}; derive one with craft_rag.stores.namespace_for_salt(salt)"
        )
        raise ValueError(msg)
    return namespace


def namespace_label(namespace: str) -> str:
    """``namespace`` as error messages and logs show it: a cache salt's namespace (``salt-``
    and a digest of the salt) is not named, since even a digest of a tenant's key lets a
    reader test guesses of it; other namespaces are quoted."""
    if namespace.startswith("salt-"):
        return "the namespace of a cache_salt (name not shown)"
    return f"namespace {namespace!r}"


def parse_options(url: str, query: str, allowed: Mapping[str, str]) -> dict[str, str]:
    """The ``?a=b&c=d`` options of a store URL; ``ValueError`` for an unknown or repeated one
    (``allowed`` maps each option to a description for the message)."""
    options: dict[str, str] = {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:  # its message quotes the field, which may be a misplaced secret
        msg = f"store URL {redact_url(url)!r}: the options must be name=value pairs joined by &"
        raise ValueError(msg) from None
    for name, value in pairs:
        if name not in allowed or name in options:
            known = ", ".join(f"{k} ({v})" for k, v in sorted(allowed.items())) or "none"
            msg = (
                f"store URL {redact_url(url)!r}: unknown or repeated option {name[:40]!r}; "
                f"options: {known}"
            )
            raise ValueError(msg)
        options[name] = value
    return options


def positive_int_option(url: str, options: Mapping[str, str], name: str, default: int) -> int:
    raw = options.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or int(raw) < 1:
        msg = (
            f"store URL {redact_url(url)!r}: {name} must be a positive integer, got "
            f"{raw[:20]!r}"
        )
        raise ValueError(msg)
    return int(raw)


SNAPSHOT_EVERY_OPTION: Mapping[str, str] = {
    "snapshot_every": "commits between snapshots; the log keeps up to twice that"
}
"""The option every backend's URL takes, as its entry in the backend's option table."""


def snapshot_every_option(url: str, options: Mapping[str, str]) -> int:
    """``?snapshot_every=N`` (a positive integer; default :data:`DEFAULT_SNAPSHOT_EVERY`)."""
    return positive_int_option(url, options, "snapshot_every", DEFAULT_SNAPSHOT_EVERY)


def fallback_option(url: str, options: Mapping[str, str]) -> str | None:
    raw = options.get("fallback")
    if raw is None:
        return None
    if raw != "memory":
        msg = (
            f"store URL {redact_url(url)!r}: fallback must be 'memory' (local state), got "
            f"{raw[:20]!r}"
        )
        raise ValueError(msg)
    return raw


class StateStore(abc.ABC):
    """Shared planner state (see the module docstring). Thread-safe; one instance may serve
    many planners (one per namespace) in one process; many processes may open the same store.

    ``url`` names the store in messages (no password); ``fallback`` is ``"memory"`` when the
    URL asked planners to go on with local state if the store becomes unreachable, else None.
    Cost of each call: one round trip to the backend (plus, rarely, one for a snapshot).
    """

    url: str
    fallback: str | None = None
    snapshot_every: int = DEFAULT_SNAPSHOT_EVERY

    # ---- primitives (one atomic round trip each) ---------------------------------------------

    @abc.abstractmethod
    def attach(self, namespace: str, fingerprint: str) -> None:
        """Check the store's format and record/check the namespace's ``fingerprint`` (the
        planner config): :class:`StoreCorrupted` naming the fix when either differs."""

    @abc.abstractmethod
    def _range(self, namespace: str, since: int) -> tuple[int, list[LogEntry]]:
        """``(head, entries with seq > since)``, atomically."""

    @abc.abstractmethod
    def _append(self, namespace: str, request: AppendRequest) -> tuple[int, list[LogEntry]]:
        """Atomically: refuse (``ConversationConflict``) when the request's conversation's
        last commit is after ``not_after`` (no check when None), and (``CommitVoided``) when
        its ``token`` was voided by :meth:`settle`; add ``data`` as entry ``head + 1``; set the
        conversation's last seq (expiring after ``ttl_s``); remember ``token`` -> seq (until
        the entry is trimmed); return ``(head, entries with seq > since)``."""

    def settle(self, namespace: str, token: str) -> int:
        """After an append carrying ``token`` failed without a clear answer (a reply later
        than the timeout, a dropped connection, a lock): atomically, the seq of the entry it
        wrote, or, when it wrote none, 0, and ``token`` is void from then on (for
        :data:`TOKEN_VOID_TTL_S`): an append carrying it (the request still on its way) is
        refused, so the answer cannot change. One round trip. An entry trimmed by a snapshot
        is no longer found (settle right after the failure, not ``snapshot_every`` commits
        later)."""
        raise NotImplementedError(f"{type(self).__name__} cannot settle an append")

    @abc.abstractmethod
    def _snapshot(self, namespace: str) -> Snapshot | None:
        """The namespace's latest snapshot, if any."""

    @abc.abstractmethod
    def put_snapshot(self, namespace: str, snapshot: Snapshot, keep_from: int) -> None:
        """Store ``snapshot`` (unless a newer one is there) and drop the entries with
        ``seq < keep_from``, atomically."""

    @abc.abstractmethod
    def put_history(
        self, namespace: str, conversation: str, version: int, data: str, ttl_s: float | None
    ) -> bool:
        """Atomically store ``data`` as ``conversation``'s prompt history at ``version``
        (expiring after ``ttl_s``) unless one of a version ``>= version`` is there; True when
        stored."""

    @abc.abstractmethod
    def get_history(self, namespace: str, conversation: str) -> HistoryRecord:
        """Atomically: the conversation record's last seq and the stored prompt history."""

    @abc.abstractmethod
    def clear(self, namespace: str) -> None:
        """Delete everything of ``namespace`` (log, conversations, histories, snapshot,
        fingerprint)."""

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release connections; the store may not be used afterwards."""

    # ---- the gap logic, once ------------------------------------------------------------------

    def read(self, namespace: str, since: int) -> LogRead:
        """Everything a reader that applied up to ``since`` must apply next."""
        head, entries = self._range(namespace, since)
        return self._complete(namespace, since, head, entries)

    def append(
        self,
        namespace: str,
        data: str,
        *,
        since: int,
        conversation: str | None = None,
        not_after: int | None = None,
        ttl_s: float | None = None,
        token: str | None = None,
    ) -> LogRead:
        """Append one entry (see :meth:`_append`) and return what the caller at ``since`` must
        apply, its own entry included (last)."""
        request = AppendRequest(data, since, conversation, not_after, ttl_s, token)
        head, entries = self._append(namespace, request)
        return self._complete(namespace, since, head, entries)

    def _complete(
        self, namespace: str, since: int, head: int, entries: list[LogEntry]
    ) -> LogRead:
        if head < since:
            msg = (
                f"store {self.url} {namespace_label(namespace)} went back from seq {since} to "
                f"{head}: "
                "it was flushed, restored from an older copy or replaced while workers used it; "
                "restart every worker of this namespace (they rebuild their state from the store)"
            )
            raise StoreCorrupted(msg)
        if head == since or (entries and entries[0].seq <= since + 1):
            self._check_contiguous(namespace, since, entries, head)
            return LogRead(head, tuple(entries))
        if entries:  # damage among the entries themselves, whatever the snapshot says
            self._check_contiguous(namespace, entries[0].seq - 1, entries, head)
        snapshot = self._snapshot(namespace)
        if snapshot is None or snapshot.seq <= since:
            msg = (
                f"store {self.url} {namespace_label(namespace)} lacks the entries after seq "
                f"{since} "
                "and has no snapshot to resume from (damaged or edited by another program); "
                "clear the namespace (StateStore.clear) or use a fresh store"
            )
            raise StoreCorrupted(msg)
        head, entries = self._range(namespace, snapshot.seq)
        if snapshot.seq > head:  # read after the snapshot was: a head below it is damage
            msg = (
                f"store {self.url} {namespace_label(namespace)}: the snapshot at seq "
                f"{snapshot.seq} is past the log's head {head}; the store was damaged or "
                "edited; clear the namespace or use a fresh store"
            )
            raise StoreCorrupted(msg)
        if entries and entries[0].seq > snapshot.seq + 1:
            # Another snapshot and trim landed between the two reads: start over from it (a
            # newer snapshot each time, so this ends; damaged data is refused below).
            newer = self._snapshot(namespace)
            if newer is not None and newer.seq > snapshot.seq:
                return self.read(namespace, since)
        self._check_contiguous(namespace, snapshot.seq, entries, head)
        return LogRead(head, tuple(entries), snapshot)

    def _fingerprint_mismatch(self, namespace: str, found: str) -> StoreCorrupted:
        """The error :meth:`attach` raises when ``namespace`` holds the state of a planner whose
        config fingerprint is ``found`` (one message for every backend)."""
        msg = (
            f"store {self.url} {namespace_label(namespace)} holds state of another planner "
            f"config ({found}); use the same PlannerConfig in every worker or another namespace"
        )
        return StoreCorrupted(msg)

    def _corrupted(self, namespace: str | None, what: str, detail: str) -> StoreCorrupted:
        """The error for a stored value of the wrong shape: names the store, the namespace
        (None: store-wide) and ``what`` (the entry, key or row); ``detail`` must already be
        bounded (see :func:`craft_rag.stores.json_codec.preview`)."""
        where = f"store {self.url}"
        if namespace is not None:
            where += f" {namespace_label(namespace)}"
        msg = (
            f"{where}: {what} is not what craft-rag writes ({detail}); the store was damaged "
            "or written by another program; clear the namespace or use a fresh store"
        )
        return StoreCorrupted(msg)

    def _check_contiguous(
        self, namespace: str, since: int, entries: list[LogEntry], head: int
    ) -> None:
        """``entries`` are ``since + 1 .. head``, each once, in order (O(len(entries)))."""
        expected = since
        for expected, entry in enumerate(entries, start=since + 1):
            if entry.seq != expected:
                found = (
                    f"log entry {entry.seq} appears twice or out of order"
                    if entry.seq < expected
                    else f"log entry {expected} is missing (found {entry.seq})"
                )
                msg = (
                    f"store {self.url} {namespace_label(namespace)}: {found}; the store was "
                    "damaged; clear the namespace or use a fresh store"
                )
                raise StoreCorrupted(msg)
        if entries and expected != head:
            msg = (
                f"store {self.url} {namespace_label(namespace)}: log entry {expected} is past "
                f"the head {head}; the store was damaged; clear the namespace or use a fresh "
                "store"
            )
            raise StoreCorrupted(msg)

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def conflict_message(conversation: str, last: int, not_after: int) -> str:
    return (
        f"conversation {conversation!r} moved on: another worker committed its turn at seq "
        f"{last} after this turn was planned (at seq {not_after}); plan the turn again"
    )
