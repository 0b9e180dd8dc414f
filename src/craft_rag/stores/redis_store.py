"""``redis://host:port/db``: the store in Redis, shared by workers on many hosts.

Every write is one Lua script (atomic on the server): ``append`` checks the conversation record,
``INCR``s the namespace's head, adds the entry to a sorted set scored by ``seq`` and sets the
conversation record with the conversation TTL (``PX``), then returns the entries the caller has
not seen, all in one round trip. Keys are ``craft-rag:{<namespace>}:...``: the braces are a
Redis Cluster hash tag, so a namespace's keys share one slot and the scripts stay legal there.
Conversation ids appear only as SHA-256 digests in key names.

``?fallback=memory`` lets planners go on with their local state when Redis cannot be reached
(a warning is logged; the planner stops sharing until it is recreated). Without it an
unreachable Redis raises :class:`StoreUnavailable` naming the URL and how to start Redis.
Needs the ``redis`` client (``pip install 'craft-rag[redis]'``).
"""

from __future__ import annotations

import hashlib
from typing import Any
from urllib.parse import unquote, urlsplit

from craft_rag.redact import MASK, redact_url
from craft_rag.stores import base
from craft_rag.stores.json_codec import MAX_STORED_INT, preview
from craft_rag.validation import check_number

_OPTIONS = {
    **base.SNAPSHOT_EVERY_OPTION,
    "fallback": "memory: go on with local state (logged) when Redis is unreachable",
    "timeout_ms": "connect and read timeout per call (default 2000)",
}

# KEYS: head, log, conv (or head again when none), tokens (append token -> seq, scored by
# seq), void (a token's void key, or head again when none). ARGV: data, since, has_conv,
# not_after ('' = no check), ttl_ms ('' = no expiry), token ('' = none). Returns {-1, last} on
# conflict, {-2, 0} for a voided token, else {head, entries}.
_APPEND = """
if ARGV[6] ~= '' and redis.call('EXISTS', KEYS[5]) == 1 then return {-2, 0} end
if ARGV[3] == '1' and ARGV[4] ~= '' then
  local last = tonumber(redis.call('GET', KEYS[3]) or '0')
  if last > tonumber(ARGV[4]) then return {-1, last} end
end
local head = redis.call('INCR', KEYS[1])
redis.call('ZADD', KEYS[2], head, head .. '|' .. ARGV[1])
if ARGV[6] ~= '' then redis.call('ZADD', KEYS[4], head, ARGV[6]) end
if ARGV[3] == '1' then
  if ARGV[5] ~= '' then
    redis.call('SET', KEYS[3], head, 'PX', ARGV[5])
  else
    redis.call('SET', KEYS[3], head)
  end
end
return {head, redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. ARGV[2], '+inf')}
"""

# KEYS: head, log. ARGV: since. Returns {head as stored (checked by the caller), entries}.
_RANGE = """
local head = redis.call('GET', KEYS[1]) or '0'
return {head, redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. ARGV[1], '+inf')}
"""

# KEYS: tokens, void key. ARGV: token, void ttl_ms. Returns the token's seq, or 0 (then void).
_SETTLE = """
local seq = redis.call('ZSCORE', KEYS[1], ARGV[1])
if seq then return tonumber(seq) end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
return 0
"""

# KEYS: history hash. ARGV: version, data, ttl_ms ('' = no expiry). Returns 1 when stored.
_PUT_HISTORY = """
local current = tonumber(redis.call('HGET', KEYS[1], 'v') or '-1')
if current >= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'v', ARGV[1], 'd', ARGV[2])
if ARGV[3] ~= '' then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
else
  redis.call('PERSIST', KEYS[1])
end
return 1
"""

# KEYS: conv, history hash. Returns {last seq or false, version or false, data or false}.
_GET_HISTORY = """
local h = redis.call('HMGET', KEYS[2], 'v', 'd')
return {redis.call('GET', KEYS[1]), h[1], h[2]}
"""

# KEYS: snapshot hash, log, tokens. ARGV: seq, state, keep_from.
_PUT_SNAPSHOT = """
local current = tonumber(redis.call('HGET', KEYS[1], 'seq') or '-1')
if current < tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'seq', ARGV[1], 'state', ARGV[2])
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[3])
if KEYS[3] then redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[3]) end
return 1
"""

# KEYS: format key, fingerprint key. ARGV: format, fingerprint. Returns {format, fingerprint}
# as stored (set when absent).
_ATTACH = """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
redis.call('SET', KEYS[2], ARGV[2], 'NX')
return {redis.call('GET', KEYS[1]), redis.call('GET', KEYS[2])}
"""


def _ttl_ms(ttl_s: float | None) -> str:
    """A TTL as the scripts take it: whole milliseconds, at least 1 ('' = no expiry)."""
    return "" if ttl_s is None else str(max(1, round(ttl_s * 1000)))


def _display(url: str) -> str:
    """``url`` without its password and options (for messages and reprs)."""
    return redact_url(url.split("?", 1)[0].split("#", 1)[0])


def _check_url(url: str) -> list[str]:
    """``ValueError`` (naming the URL without its secrets) unless ``url`` is
    ``redis[s]://[[user]:password@]host[:port][/db]``; its secrets (to scrub from client
    errors, which may quote the URL)."""
    display = redact_url(url)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        msg = f"store URL {display!r}: not HOST[:PORT] with a port 1-65535 (redis://host:6379/0)"
        raise ValueError(msg) from None
    if port is not None and not 0 < port < 65536:
        msg = f"store URL {display!r}: the port must be a number 1-65535 (redis://host:6379/0)"
        raise ValueError(msg)
    if parts.path not in ("", "/") and not (
        parts.path[1:].isdigit() and parts.path[1:].isascii()
    ):
        msg = f"store URL {display!r}: the path must be a database number, e.g. redis://host/0"
        raise ValueError(msg)
    if parts.fragment:
        msg = f"store URL {display!r}: a store URL has no #fragment"
        raise ValueError(msg)
    # A user name alone (redis://KEY@host) may be the secret; beside a password it is not.
    # Strings under 4 characters are not scrubbed: they would garble the message, and no
    # client error quotes them.
    secret = parts.password if parts.password else parts.username
    found = [s for s in (secret, unquote(secret or "")) if s and len(s) >= 4]
    return list(dict.fromkeys(found))


class RedisStore(base.StateStore):
    """Store in Redis (see the module docstring). Thread-safe (redis-py's connection pool);
    every call is one round trip."""

    def __init__(
        self,
        client_url: str,
        *,
        snapshot_every: int = base.DEFAULT_SNAPSHOT_EVERY,
        fallback: str | None = None,
        timeout_s: float = 2.0,
        url: str | None = None,
    ) -> None:
        try:
            import redis
        except ImportError as e:
            msg = "the redis store needs the redis client: pip install 'craft-rag[redis]'"
            raise ImportError(msg) from e
        self._redis = redis
        check_number(timeout_s, "timeout_s (seconds)", positive=True)
        self.url = _display(url or client_url)
        self._secrets = _check_url(client_url)
        self.snapshot_every = snapshot_every
        self.fallback = fallback
        try:
            self._client: Any = redis.Redis.from_url(
                client_url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
            )
        except ValueError as e:  # the client's message may quote the URL, secrets and all
            msg = f"store URL {self.url!r} is not a Redis URL ({self._scrub(e)})"
            raise ValueError(msg) from None
        self._append_script = self._client.register_script(_APPEND)
        self._range_script = self._client.register_script(_RANGE)
        self._snapshot_script = self._client.register_script(_PUT_SNAPSHOT)
        self._attach_script = self._client.register_script(_ATTACH)
        self._put_history_script = self._client.register_script(_PUT_HISTORY)
        self._settle_script = self._client.register_script(_SETTLE)
        self._get_history_script = self._client.register_script(_GET_HISTORY)

    @classmethod
    def from_url(cls, url: str) -> RedisStore:
        address, _, query = url.partition("?")
        options = base.parse_options(url, query, _OPTIONS)
        return cls(
            address,
            snapshot_every=base.snapshot_every_option(url, options),
            fallback=base.fallback_option(url, options),
            timeout_s=base.positive_int_option(url, options, "timeout_ms", 2000) / 1000,
            url=address,
        )

    @staticmethod
    def _key(namespace: str, name: str) -> str:
        return f"craft-rag:{{{base.check_namespace(namespace)}}}:{name}"

    def _scrub(self, error: BaseException) -> str:
        """``error``'s text with this store's secrets masked (client errors may quote the
        URL or the credentials); bounded."""
        text = str(error)
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        return (redact_url(text) if "@" in text else text)[:500]

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one client call; connection faults -> :class:`StoreUnavailable` with the fix,
        wrong key types (keys written by another program) -> :class:`StoreCorrupted`."""
        errors = self._redis.exceptions
        try:
            return fn(*args, **kwargs)
        except (errors.ConnectionError, errors.TimeoutError) as e:
            msg = (
                f"cannot reach Redis at {self.url} ({self._scrub(e)}); start it (redis-server "
                "--bind 127.0.0.1 --port 6379, see docs/deployment.md), fix the URL, or add "
                "?fallback=memory to go on with local (unshared) state"
            )
            raise base.StoreUnavailable(msg) from e
        except errors.ResponseError as e:
            msg = (
                f"store {self.url} holds keys craft-rag cannot use ({self._scrub(e)}); delete the "
                "craft-rag:* keys of this namespace or use another Redis database"
            )
            raise base.StoreCorrupted(msg) from e

    def _int(self, raw: object, namespace: str | None, what: str) -> int:
        """A stored count or seq: ASCII digits (Lua's ``tonumber`` would also take ``2.5``,
        `` 3 `` or ``1e23``); :class:`StoreCorrupted` naming ``what`` otherwise."""
        if type(raw) is int and 0 <= raw <= MAX_STORED_INT:
            return raw
        if isinstance(raw, bytes) and raw.isdigit() and len(raw) <= 19:
            value = int(raw)
            if value <= MAX_STORED_INT:
                return value
        raise self._corrupted(namespace, what, f"found {preview(raw)}")

    def _text(self, raw: bytes, namespace: str | None, what: str) -> str:
        try:
            return raw.decode("utf-8")
        except (UnicodeDecodeError, AttributeError):
            raise self._corrupted(namespace, what, f"not UTF-8 text: {preview(raw)}") from None

    def _entries(self, raw: list[bytes], namespace: str, since: int) -> list[base.LogEntry]:
        """The log members ``seq|data`` (``since``: the seq before the first, for messages).
        O(total size): one split and one decode per member."""
        out = []
        for position, member in enumerate(raw, start=since + 1):
            seq, sep, data = member.partition(b"|")
            if not sep or not seq.isdigit() or seq.startswith(b"0") or len(seq) > 19:
                what = f"log entry {position} (member {preview(member)})"
                raise self._corrupted(namespace, what, "not 'seq|entry'")
            out.append(
                base.LogEntry(int(seq), self._text(data, namespace, f"log entry {int(seq)}"))
            )
        return out

    def attach(self, namespace: str, fingerprint: str) -> None:
        keys = ["craft-rag:format", self._key(namespace, "fingerprint")]
        stored = self._call(self._attach_script, keys=keys, args=[base.STORE_FORMAT, fingerprint])
        found_format = self._text(stored[0], None, "the format key craft-rag:format")
        found_fingerprint = self._text(stored[1], namespace, "the config fingerprint")
        if found_format != base.STORE_FORMAT:
            msg = (
                f"store {self.url} has format {found_format!r}, this craft-rag reads "
                f"{base.STORE_FORMAT!r}; use another Redis database (/N in the URL) or delete its "
                "craft-rag:* keys"
            )
            raise base.StoreCorrupted(msg)
        if found_fingerprint != fingerprint:
            raise self._fingerprint_mismatch(namespace, found_fingerprint)

    def _range(self, namespace: str, since: int) -> tuple[int, list[base.LogEntry]]:
        keys = [self._key(namespace, "head"), self._key(namespace, "log")]
        head, raw = self._call(self._range_script, keys=keys, args=[since])
        return self._int(head, namespace, "the log head"), self._entries(raw, namespace, since)

    def _append(
        self, namespace: str, request: base.AppendRequest
    ) -> tuple[int, list[base.LogEntry]]:
        conversation, token = request.conversation, request.token
        head_key = self._key(namespace, "head")
        conv_key = head_key
        if conversation is not None:
            conv_key = self._conv_key(namespace, "conv", conversation)
        args = [
            request.data,
            request.since,
            "1" if conversation is not None else "0",
            "" if request.not_after is None else str(request.not_after),
            _ttl_ms(request.ttl_s),
            "" if token is None else token,
        ]
        void_key = head_key if token is None else self._token_key(namespace, token)
        keys = [
            head_key, self._key(namespace, "log"), conv_key, self._key(namespace, "tokens"),
            void_key,
        ]
        head, payload = self._call(self._append_script, keys=keys, args=args)
        if int(head) == -2:
            raise request.voided()
        if int(head) == -1:
            raise request.conflict(int(payload))
        return int(head), self._entries(payload, namespace, request.since)

    def _token_key(self, namespace: str, token: str) -> str:
        digest = hashlib.sha256(token.encode("utf-8")).hexdigest()
        return self._key(namespace, f"void:{digest}")

    def settle(self, namespace: str, token: str) -> int:
        keys = [self._key(namespace, "tokens"), self._token_key(namespace, token)]
        ttl = str(round(base.TOKEN_VOID_TTL_S * 1000))
        return int(self._call(self._settle_script, keys=keys, args=[token, ttl]))

    def _conv_key(self, namespace: str, kind: str, conversation: str) -> str:
        digest = hashlib.sha256(conversation.encode("utf-8")).hexdigest()
        return self._key(namespace, f"{kind}:{digest}")

    def put_history(
        self, namespace: str, conversation: str, version: int, data: str, ttl_s: float | None
    ) -> bool:
        key = self._conv_key(namespace, "hist", conversation)
        args = [version, data, _ttl_ms(ttl_s)]
        return bool(self._call(self._put_history_script, keys=[key], args=args))

    def get_history(self, namespace: str, conversation: str) -> base.HistoryRecord:
        keys = [
            self._conv_key(namespace, "conv", conversation),
            self._conv_key(namespace, "hist", conversation),
        ]
        last, version, data = self._call(self._get_history_script, keys=keys, args=[])
        what = f"the record of conversation {preview(conversation)}"
        last_seq = 0 if last is None else self._int(last, namespace, what)
        if version is None or data is None:
            return base.HistoryRecord(last_seq)
        what = f"the prompt history of conversation {preview(conversation)}"
        return base.HistoryRecord(
            last_seq, self._int(version, namespace, what), self._text(data, namespace, what)
        )

    def _snapshot(self, namespace: str) -> base.Snapshot | None:
        seq, state = self._call(
            self._client.hmget, self._key(namespace, "snapshot"), ["seq", "state"]
        )
        if seq is None or state is None:
            return None
        at = self._int(seq, namespace, "the snapshot's seq")
        return base.Snapshot(at, self._text(state, namespace, f"the snapshot at seq {at}"))

    def put_snapshot(self, namespace: str, snapshot: base.Snapshot, keep_from: int) -> None:
        keys = [
            self._key(namespace, "snapshot"), self._key(namespace, "log"),
            self._key(namespace, "tokens"),
        ]
        self._call(
            self._snapshot_script, keys=keys, args=[snapshot.seq, snapshot.state, keep_from]
        )

    def clear(self, namespace: str) -> None:
        names = ["head", "log", "snapshot", "fingerprint", "tokens"]
        keys = [self._key(namespace, n) for n in names]
        for kind in ("conv", "hist", "void"):
            pattern = self._key(namespace, f"{kind}:*")
            keys += self._call(lambda p=pattern: list(self._client.scan_iter(match=p, count=1000)))
        self._call(self._client.delete, *keys)

    def ping(self) -> None:
        """One round trip; :class:`StoreUnavailable` when Redis cannot be reached."""
        self._call(self._client.ping)

    def close(self) -> None:
        self._client.close()
