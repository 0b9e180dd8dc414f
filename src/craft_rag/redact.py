"""Secrets out of messages: :func:`redact_url` for any URL shown in an error, log line or repr.

A store or server URL may carry a password (``redis://user:pw@host``), an API key as the
userinfo (``https://key@host``) or a secret option (``?password=...``, ``?api_key=...``).
Messages about such a URL show :func:`redact_url`'s form: the scheme, the user name (when a
password follows it), host, port, path and the options, with every secret replaced by
``***``. It never raises, and it errs towards hiding: a malformed URL (a password holding an
unescaped ``/``, ``?``, ``#`` or ``@``; a "port" that is not a number) loses the doubtful part
rather than showing it. Cost: a few string scans, no allocation beyond the result.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

MASK = "***"

_SECRET_OPTION_RE = re.compile(
    r"pass|pwd|secret|token|key|auth|credential|signature|sig$|session", re.IGNORECASE
)
"""Option names whose value is hidden (``password``, ``api_key``, ``access_token``, ...)."""

_PORT_RE = re.compile(r"^[0-9]*$")


def is_secret_option(name: str) -> bool:
    """Whether a URL option (query parameter) named ``name`` holds a secret."""
    return bool(_SECRET_OPTION_RE.search(unquote(name)))


def _redact_query(text: str) -> str:
    """``a=b&password=c`` -> ``a=b&password=***`` (``&`` and ``;`` separate options); a
    field without ``=`` (a secret pasted in the wrong place?) is hidden whole."""
    parts = re.split(r"([&;])", text)
    for i in range(0, len(parts), 2):
        name, eq, _ = parts[i].partition("=")
        if eq and is_secret_option(name):
            parts[i] = f"{name}={MASK}"
        elif not eq and parts[i]:
            parts[i] = MASK
    return "".join(parts)


def _redact_hostport(hostport: str) -> str:
    """``host:6379`` unchanged; ``host:notaport`` (likely ``user:password`` without its
    ``@host``) -> ``host:***``."""
    if hostport.startswith("["):  # IPv6 literal: [::1]:port
        close = hostport.find("]")
        host, port = (hostport, "") if close < 0 else (hostport[: close + 1], hostport[close + 1 :])
        if port and not (port.startswith(":") and _PORT_RE.match(port[1:])):
            return f"{host}:{MASK}"
        return hostport
    host, colon, port = hostport.partition(":")
    if colon and not _PORT_RE.match(port):
        return f"{host}:{MASK}"
    return hostport


def redact_url(url: str) -> str:
    """``url`` with its password, userinfo secret and secret options replaced by ``***``
    (see the module docstring); anything that is not a ``str`` is shown as its type only."""
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    # The authority normally ends at the first '/', '?' or '#'. A password holding one of
    # them unescaped moves that end before its '@': then the last '@' of the whole URL is
    # taken as the end of the userinfo, so no part of the password is shown.
    end = len(rest)
    for ch in "/?#":
        at = rest.find(ch)
        if 0 <= at < end:
            end = at
    authority, tail = rest[:end], rest[end:]
    cut = authority.rfind("@")
    # An '@' after the apparent authority means the password held '/', '?' or '#' (and
    # maybe '@'): the userinfo ends at the URL's last '@' ('u:p@S/x@host' hides 'p@S/x').
    if authority and "@" in tail:
        cut = rest.rfind("@")
        # Re-split what follows the '@' into host and path/options.
        after = rest[cut + 1 :]
        end = len(after)
        for ch in "/?#":
            at = after.find(ch)
            if 0 <= at < end:
                end = at
        authority, tail = rest[: cut + 1 + end], after[end:]
    if cut >= 0:
        userinfo, hostport = authority[:cut], authority[cut + 1 :]
        user, colon, _ = userinfo.partition(":")
        shown_user = f"{user}:" if colon and user and not re.search(r"[/?#]", user) else ""
        authority = f"{shown_user}{MASK}@{_redact_hostport(hostport)}"
    else:
        authority = _redact_hostport(authority)
    path, qmark, query = tail.partition("?")
    query, hash_, fragment = query.partition("#") if qmark else ("", "", "")
    if not qmark:
        path, hash_, fragment = tail.partition("#")
    out = f"{scheme}{sep}{authority}{path}"
    if qmark:
        out += f"?{_redact_query(query)}"
    if hash_:
        out += f"#{_redact_query(fragment)}"
    return out


__all__ = ["MASK", "is_secret_option", "redact_url"]
