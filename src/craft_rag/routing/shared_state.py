"""The routing state that several app workers' routers share: conversation homes and loads.

N app workers, each with its own :class:`~craft_rag.routing.Router` over the same replicas,
route as one router would when they share what a decision reads besides the trees:

- **homes**: the replica homing each conversation (a (salt, id) pair). The first worker to
  route a conversation claims its home (first writer wins: a worker that lost the race sends
  the turn to the winner's replica); a worker that finds the home down re-homes it (the new
  home replaces the old one only while the old one is still there, compare-and-set);
- **loads**: each worker's own in-flight load on each replica (requests, prompt tokens,
  predicted prefill seconds, assigned count), published by that worker after each routing
  call under a lease; a router adds the other live workers' loads to its own. A worker that
  crashes stops renewing its lease, so its load stops counting ``lease_s`` later.

The trees are not here: each replica's CP-Trees are shared through the planners' store
(a commit log per replica namespace, pulled before each decision) and kept true by each
worker's own KV events. See docs/routing.md, "Several app workers", for the consistency model.

:class:`RoutingState` is the narrow interface the router uses; :class:`MemoryRoutingState` is
one process's (routers built on one object share it: the unit tests, ``memory://``), and
:class:`RedisRoutingState` is Redis's (atomic single-key operations and one Lua read).
A router without a state object (``Router(shared=None)``, the default) keeps everything local,
as before.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from craft_rag.routing.replica import ConversationKey, ReplicaId, ReplicaLoad
from craft_rag.validation import check_number

__all__ = [
    "DEFAULT_HOME_TTL_S",
    "DEFAULT_LOAD_LEASE_S",
    "MemoryRoutingState",
    "RedisRoutingState",
    "RoutingState",
    "routing_scope",
    "routing_state_for",
]

DEFAULT_LOAD_LEASE_S = 30.0
"""A worker's published load counts this long after its last routing call (renewed on each
route and finish): a crashed worker's load is gone from the others' view after at most this."""
DEFAULT_HOME_TTL_S = 86_400.0
"""A conversation home not routed for this long is forgotten (renewed on each turn)."""


def routing_scope(replicas: Iterable[str]) -> str:
    """The scope of a replica set's shared routing state: a digest of its sorted replica ids,
    so workers listing the same servers in any order share it, and another set never does."""
    joined = "\n".join(sorted(str(r) for r in replicas))
    return hashlib.sha256(joined.encode("utf-8")).hexdigest()[:16]


def conversation_field(conv: ConversationKey) -> str:
    """A conversation's key in shared state: digests of its salt and id (no tenant key and no
    user text reaches the store; fixed length)."""
    salt, cid = conv
    h = hashlib.sha256()
    h.update(b"-" if salt is None else b"s" + salt.encode("utf-8"))
    h.update(b"\x00")
    h.update(cid.encode("utf-8"))
    return h.hexdigest()[:40]


class RoutingState(Protocol):
    """What a router shares with other workers' routers. Every method is one atomic step of
    the backend (one round trip for Redis); thread-safe."""

    worker: str
    """This worker's id (random per router)."""

    def home(self, conv: ConversationKey) -> ReplicaId | None:
        """``conv``'s home (None: none), renewing its TTL."""
        ...

    def claim_home(
        self, conv: ConversationKey, replica: ReplicaId, *, replacing: ReplicaId | None = None
    ) -> ReplicaId:
        """Make ``replica`` ``conv``'s home if it has none, or, with ``replacing``, if its
        home is still ``replacing`` (a lost replica); returns the home after the step (another
        worker's, when it won)."""
        ...

    def end_home(self, conv: ConversationKey) -> bool:
        """Forget ``conv``'s home; True if there was one."""
        ...

    def publish_loads(self, loads: Mapping[ReplicaId, ReplicaLoad]) -> None:
        """This worker's own load on each replica now (replacing what it published before;
        renews its lease). An empty mapping withdraws it."""
        ...

    def other_loads(self) -> dict[ReplicaId, ReplicaLoad]:
        """The sum of every other live worker's published load, per replica."""
        ...

    def close(self) -> None:
        """Withdraw this worker's loads and release connections."""
        ...


def _add(into: dict[ReplicaId, ReplicaLoad], replica: ReplicaId, load: ReplicaLoad) -> None:
    total = into.get(replica)
    if total is None:
        into[replica] = ReplicaLoad(load.requests, load.prompt_tokens, load.work_s, load.assigned)
        return
    total.requests += load.requests
    total.prompt_tokens += load.prompt_tokens
    total.work_s += load.work_s
    total.assigned += load.assigned


class _MemoryShared:
    """The state behind :class:`MemoryRoutingState` views (one per process scope)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.lock = threading.Lock()
        self.clock = clock
        self.homes: dict[str, tuple[ReplicaId, float]] = {}  # field -> (home, expiry)
        # worker -> (its loads, lease expiry)
        self.loads: dict[str, tuple[dict[ReplicaId, ReplicaLoad], float]] = {}


class MemoryRoutingState:
    """Routing state in this process: routers given views of one :meth:`shared` object route
    as one (the default is a router of its own). Same semantics as Redis, leases and TTLs
    included, on ``clock``."""

    def __init__(
        self,
        *,
        lease_s: float = DEFAULT_LOAD_LEASE_S,
        home_ttl_s: float = DEFAULT_HOME_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        _shared: _MemoryShared | None = None,
    ) -> None:
        check_number(lease_s, "lease_s (seconds)", positive=True)
        check_number(home_ttl_s, "home_ttl_s (seconds)", positive=True)
        self.worker = secrets.token_hex(8)
        self.lease_s = lease_s
        self.home_ttl_s = home_ttl_s
        self._s = _shared or _MemoryShared(clock)

    def view(self) -> MemoryRoutingState:
        """Another worker's view of the same state (its own worker id)."""
        return MemoryRoutingState(
            lease_s=self.lease_s, home_ttl_s=self.home_ttl_s, clock=self._s.clock, _shared=self._s
        )

    def home(self, conv: ConversationKey) -> ReplicaId | None:
        s, key = self._s, conversation_field(conv)
        with s.lock:
            found = s.homes.get(key)
            now = s.clock()
            if found is None or found[1] <= now:
                s.homes.pop(key, None)
                return None
            s.homes[key] = (found[0], now + self.home_ttl_s)
            return found[0]

    def claim_home(
        self, conv: ConversationKey, replica: ReplicaId, *, replacing: ReplicaId | None = None
    ) -> ReplicaId:
        s, key = self._s, conversation_field(conv)
        with s.lock:
            now = s.clock()
            found = s.homes.get(key)
            current = found[0] if found is not None and found[1] > now else None
            if current is None or current == replacing:
                current = replica
            s.homes[key] = (current, now + self.home_ttl_s)
            return current

    def end_home(self, conv: ConversationKey) -> bool:
        s, key = self._s, conversation_field(conv)
        with s.lock:
            found = s.homes.pop(key, None)
            return found is not None and found[1] > s.clock()

    def publish_loads(self, loads: Mapping[ReplicaId, ReplicaLoad]) -> None:
        s = self._s
        with s.lock:
            if not loads:
                s.loads.pop(self.worker, None)
                return
            copy = {r: ReplicaLoad(x.requests, x.prompt_tokens, x.work_s, x.assigned)
                    for r, x in loads.items()}
            s.loads[self.worker] = (copy, s.clock() + self.lease_s)

    def other_loads(self) -> dict[ReplicaId, ReplicaLoad]:
        s = self._s
        out: dict[ReplicaId, ReplicaLoad] = {}
        with s.lock:
            now = s.clock()
            for worker, (loads, expiry) in list(s.loads.items()):
                if expiry <= now:
                    del s.loads[worker]
                    continue
                if worker != self.worker:
                    for replica, load in loads.items():
                        _add(out, replica, load)
        return out

    def close(self) -> None:
        self.publish_loads({})


# Every other live worker's loads in one round trip: the workers set, then each one's hash
# (an expired hash is gone: its worker leaves the set). Single-node Redis (the keys share one
# hash tag, so a cluster keeps them on one node too).
_READ_LOADS = """
local out = {}
for _, w in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local v = redis.call('HGETALL', ARGV[1] .. w)
  if #v == 0 then
    redis.call('SREM', KEYS[1], w)
  elseif w ~= ARGV[2] then
    table.insert(out, w)
    table.insert(out, v)
  end
end
return out
"""

# Claim a home: set it when absent or still ARGV[3] (the replica being replaced); renew the
# TTL; return the home.
_CLAIM_HOME = """
local cur = redis.call('GET', KEYS[1])
if (not cur) or (ARGV[3] ~= '' and cur == ARGV[3]) then
  cur = ARGV[1]
end
redis.call('SET', KEYS[1], cur, 'PX', ARGV[2])
return cur
"""


class RedisRoutingState:
    """Routing state in Redis, beside the planners' store (same database). Keys (one hash
    tag per replica set, so they stay together): ``home:<digest>`` per conversation (string,
    TTL ``home_ttl_s``), ``load:<worker>`` per worker (hash replica -> ``requests
    prompt_tokens work_s assigned``, lease ``lease_s``) and ``workers`` (set). ``client``: a
    redis-py client; ``call`` runs one client call and maps connection faults to
    :class:`~craft_rag.stores.StoreUnavailable` (the store's own). Values read back are
    checked: a malformed one is ignored (logged by the caller's store errors, never trusted as
    a replica id it does not know)."""

    def __init__(
        self,
        client: Any,
        call: Callable[..., Any],
        scope: str,
        *,
        lease_s: float = DEFAULT_LOAD_LEASE_S,
        home_ttl_s: float = DEFAULT_HOME_TTL_S,
    ) -> None:
        check_number(lease_s, "lease_s (seconds)", positive=True)
        check_number(home_ttl_s, "home_ttl_s (seconds)", positive=True)
        if not scope.isalnum():
            msg = f"scope must be letters and digits (routing_scope(...)), got {scope!r}"
            raise ValueError(msg)
        self.worker = secrets.token_hex(8)
        self.lease_s = lease_s
        self.home_ttl_s = home_ttl_s
        self._client = client
        self._call = call
        self._prefix = f"craft-rag:{{routing.{scope}}}:"
        self._workers_key = self._prefix + "workers"
        self._read = client.register_script(_READ_LOADS)
        self._claim = client.register_script(_CLAIM_HOME)
        self._published = False

    def _home_key(self, conv: ConversationKey) -> str:
        return self._prefix + "home:" + conversation_field(conv)

    @staticmethod
    def _text(raw: object) -> str | None:
        if isinstance(raw, bytes):
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                return None
        return raw if isinstance(raw, str) else None

    def home(self, conv: ConversationKey) -> ReplicaId | None:
        ttl_ms = int(self.home_ttl_s * 1000)
        raw = self._call(self._client.getex, self._home_key(conv), px=ttl_ms)
        text = self._text(raw)
        return ReplicaId(text) if text else None

    def claim_home(
        self, conv: ConversationKey, replica: ReplicaId, *, replacing: ReplicaId | None = None
    ) -> ReplicaId:
        ttl_ms = int(self.home_ttl_s * 1000)
        raw = self._call(
            self._claim, keys=[self._home_key(conv)], args=[replica, ttl_ms, replacing or ""]
        )
        text = self._text(raw)
        return ReplicaId(text) if text else replica

    def end_home(self, conv: ConversationKey) -> bool:
        return bool(self._call(self._client.delete, self._home_key(conv)))

    def publish_loads(self, loads: Mapping[ReplicaId, ReplicaLoad]) -> None:
        key = self._prefix + "load:" + self.worker
        if not loads:
            if self._published:
                self._call(self._client.delete, key)
                self._published = False
            return
        mapping = {
            r: f"{x.requests} {x.prompt_tokens} {x.work_s!r} {x.assigned}" for r, x in loads.items()
        }
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(key)
        pipe.hset(key, mapping=mapping)
        pipe.pexpire(key, int(self.lease_s * 1000))
        pipe.sadd(self._workers_key, self.worker)
        self._call(pipe.execute)
        self._published = True

    def other_loads(self) -> dict[ReplicaId, ReplicaLoad]:
        raw = self._call(
            self._read, keys=[self._workers_key], args=[self._prefix + "load:", self.worker]
        )
        out: dict[ReplicaId, ReplicaLoad] = {}
        if not isinstance(raw, list):
            return out
        for fields in raw[1::2]:
            if not isinstance(fields, list):
                continue
            for name, value in zip(fields[0::2], fields[1::2], strict=False):
                replica, text = self._text(name), self._text(value)
                load = _parse_load(text)
                if replica and load is not None:
                    _add(out, ReplicaId(replica), load)
        return out

    def close(self) -> None:
        self.publish_loads({})


def _parse_load(text: str | None) -> ReplicaLoad | None:
    """``"requests prompt_tokens work_s assigned"`` -> a load; None when malformed."""
    if text is None:
        return None
    parts = text.split()
    if len(parts) != 4:
        return None
    try:
        requests, tokens, assigned = int(parts[0]), int(parts[1]), int(parts[3])
        work = float(parts[2])
    except ValueError:
        return None
    if min(requests, tokens, assigned) < 0 or not 0.0 <= work < float("inf"):
        return None
    return ReplicaLoad(requests, tokens, work, assigned)


_memory_scopes: weakref.WeakKeyDictionary[object, dict[str, MemoryRoutingState]] = (
    weakref.WeakKeyDictionary()
)
_memory_lock = threading.Lock()


def routing_state_for(
    store: object, replicas: Iterable[str], *, lease_s: float | None = None
) -> RoutingState:
    """The routing state beside ``store`` (a :class:`~craft_rag.stores.StateStore`) for this
    replica set: Redis's for a Redis store (same database), one process's for a ``memory://``
    store (engines given the same store object share it). ``ValueError`` for another backend
    (SQLite shares planner state, but the loads' leases need Redis). ``lease_s``: None reads
    :data:`DEFAULT_LOAD_LEASE_S` now."""
    from craft_rag.stores.memory_store import MemoryStore
    from craft_rag.stores.redis_store import RedisStore

    scope = routing_scope(replicas)
    if lease_s is None:
        lease_s = DEFAULT_LOAD_LEASE_S
    if isinstance(store, RedisStore):
        return RedisRoutingState(store._client, store._call, scope, lease_s=lease_s)
    if isinstance(store, MemoryStore):
        with _memory_lock:
            scopes = _memory_scopes.setdefault(store, {})
            base = scopes.get(scope)
            if base is None:
                base = scopes[scope] = MemoryRoutingState(lease_s=lease_s)
                return base
        return base.view()
    name = type(store).__name__
    msg = (
        f"store= with several servers needs a redis:// store (or memory:// within one "
        f"process), got a {name}: the workers' shared loads and conversation homes live in "
        "Redis beside the planner state"
    )
    raise ValueError(msg)
