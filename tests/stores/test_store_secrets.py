"""No store secret in any output: malformed and unreachable store URLs, each carrying a unique
secret (a Redis password, a user name used as a key, a ``?password=`` option), are opened the
ways a user would; every exception text (the whole chain, as a traceback prints it), every log
record and every repr is searched for the secret. Plus :func:`craft_rag.redact.redact_url`
itself on hostile shapes."""

from __future__ import annotations

import logging
import secrets
import traceback

import pytest

from craft_rag import CraftPlanner
from craft_rag.redact import redact_url
from craft_rag.stores import StoreUnavailable, open_store
from craft_rag.stores.local_redis import free_port

DEAD = free_port()  # nothing listens there: connection refused at once

# {S}: the secret; {dead}: a closed loopback port.
URL_SHAPES = [
    "redis://user:{S}@127.0.0.1:{dead}/0?snapshot_every=0",
    "redis://user:{S}@127.0.0.1:{dead}/0?color=red",
    "redis://user:{S}@127.0.0.1:{dead}/0?timeout_ms=abc",
    "redis://user:{S}@127.0.0.1:{dead}/0?fallback=disk",
    "redis://user:{S}@127.0.0.1:{dead}/0?timeout_ms=1&timeout_ms=2",
    "redis://user:{S}@127.0.0.1:{dead}/0?a=b&&c",
    "redis://user:{S}@127.0.0.1:notaport/0",
    "redis://user:{S}@127.0.0.1:99999/0",
    "redis://user:{S}@127.0.0.1:{dead}/abc",
    "redis://user:{S}@127.0.0.1:{dead}/0#frag",
    "redis://user:{S}",
    "redis://user:{S}@",
    "redis://user:{S}/x@127.0.0.1:{dead}/0",
    "redis://user:{S}?x@127.0.0.1:{dead}/0",
    "redis://user:{S}#x@127.0.0.1:{dead}/0",
    "redis://user:{S}@x@127.0.0.1:{dead}/0",
    "redis://user:p@{S}/x@127.0.0.1:{dead}/0",
    "redis://user:p@{S}?x@127.0.0.1:{dead}/0",
    "redis://user:{S}%2Fx@127.0.0.1:{dead}/0?timeout_ms=300",
    "redis://user:{S}@127.0.0.1:{dead}/0?timeout_ms=300",
    "rediss://user:{S}@127.0.0.1:{dead}/0?timeout_ms=300",
    "redis://:{S}@127.0.0.1:{dead}/0?timeout_ms=300",
    "redis://{S}@127.0.0.1:{dead}/0?timeout_ms=300",
    "redis://:{S}@127.0.0.1:{dead}/0?timeout_ms=300&fallback=memory",
    "REDIS://user:{S}@127.0.0.1:{dead}/0?timeout_ms=300",
    "redis://user:{S}@[::1/0",
    "redis://user:{S}@[::1]:x/0",
    "redis://127.0.0.1:{dead}/0?password={S}",
    "redis://127.0.0.1:{dead}/0?{S}",
    "redis:/user:{S}@127.0.0.1:{dead}/0",
    "user:{S}@127.0.0.1:{dead}",
    "postgres://user:{S}@127.0.0.1/db",
    "memory://user:{S}@host",
    "memory://?password={S}",
    "sqlite:///tmp/x.db?password={S}",
]


def _texts(error: BaseException) -> str:
    """What a user sees of ``error``: its traceback with every chained cause."""
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


def _attempt(url: str) -> list[str]:
    """Open ``url`` as a user would (open_store, a planner on it, a ping); every text shown."""
    shown = []
    try:
        store = open_store(url)
    except Exception as e:
        return [_texts(e)]
    shown += [repr(store), str(store.url)]
    try:
        planner = CraftPlanner(store=store)
        shown.append(repr(planner))
        shown.append(str(planner.store_fallback))
    except Exception as e:
        shown.append(_texts(e))
    ping = getattr(store, "ping", None)
    if ping is not None:
        try:
            ping()
        except Exception as e:
            shown.append(_texts(e))
    store.close()
    return shown


@pytest.mark.parametrize("shape", URL_SHAPES)
def test_no_store_secret_in_errors_logs_or_reprs(
    shape: str, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "sEcReT" + secrets.token_hex(8)
    url = shape.format(S=secret, dead=DEAD)
    with caplog.at_level(logging.DEBUG):
        shown = _attempt(url)
    shown += [r.getMessage() for r in caplog.records]
    shown += [_texts(r.exc_info[1]) for r in caplog.records if r.exc_info and r.exc_info[1]]
    assert shown, "nothing was shown at all"
    for text in shown:
        assert secret not in text, text
        assert secret[:10] not in text, text  # nor a part of it


def test_a_clear_error_still_names_the_url_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"'redis://user:\*\*\*@127.0.0.1:6379/abc'.*database"):
        open_store("redis://user:pw-1234@127.0.0.1:6379/abc")
    with pytest.raises(ValueError, match=r"redis://user:\*\*\*@127.0.0.1:1/0.*snapshot_every"):
        open_store("redis://user:pw-1234@127.0.0.1:1/0?snapshot_every=x")
    with pytest.raises(StoreUnavailable, match=r"redis://user:\*\*\*@127.0.0.1:\d+/0.*start it"):
        CraftPlanner(store=f"redis://user:pw-1234@127.0.0.1:{DEAD}/0?timeout_ms=300")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://user:pw@host:6379/0", "redis://user:***@host:6379/0"),
        ("redis://:pw@host/0?timeout_ms=5", "redis://***@host/0?timeout_ms=5"),
        ("https://apikey@api.example/v1", "https://***@api.example/v1"),
        ("rediss://user:p/w@host/0", "rediss://user:***@host/0"),
        ("redis://u:p@SECRET/x@host:6379/0", "redis://u:***@host:6379/0"),
        ("redis://user:p?w@host/0", "redis://user:***@host/0"),
        ("redis://user:p#w@host", "redis://user:***@host"),
        ("redis://user:p@w@host:1/2", "redis://user:***@host:1/2"),
        ("redis://user:pw", "redis://user:***"),
        ("redis://[::1]:pw", "redis://[::1]:***"),
        ("redis://host/0?password=pw&x=1", "redis://host/0?password=***&x=1"),
        ("https://h/v1?api_key=pw;y=2", "https://h/v1?api_key=***;y=2"),
        ("https://h/v1?access_token=pw#sig=pw", "https://h/v1?access_token=***#sig=***"),
        ("redis://host/0?pw", "redis://host/0?***"),
        ("user:pw@host", "user:***@host"),
        ("sqlite:///data/a@b/x.db", "sqlite:///data/a@b/x.db"),
        ("memory://", "memory://"),
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    ],
)
def test_redact_url_shapes(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_redact_url_never_raises() -> None:
    for value in ["", "://", "@", "a://@", "x://[", "x://]@[", "::::@@@@", "\x00://\x00@\x00",
                  "h://" + "@" * 10_000, 5, None, b"redis://u:pw@h"]:
        out = redact_url(value)  # type: ignore[arg-type]
        assert isinstance(out, str) and "pw" not in out
