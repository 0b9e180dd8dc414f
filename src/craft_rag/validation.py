"""Input checks shared by every core entry point, and the reader of saved state files.

Two kinds of checks live here:

- **argument checks** (``check_*``, :func:`validate_conversation_id`): raise ``ValueError`` whose
  message starts with the argument's name (``"window: must be ..."``) and says what is valid.
  Bools are never accepted where an int or a number is meant (``True`` is an ``int`` in Python,
  and ``window=True`` silently meaning 1 is a bug), and only bools where a bool is meant.
- **state-file checks** (``state_*``): the same, but the name is the field's JSON path in the
  saved file (``"prefix_tree.nodes[3].parent: ..."``), so a broken file names the broken spot.

Every check is O(1) except where noted; none mutates its input.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Protocol, TypeVar

from craft_rag.types import CacheSalt, ConversationId

MAX_INT = 2**63 - 1
"""Largest integer accepted for counts, token positions and stamps (what a C int64 holds)."""

_T = TypeVar("_T")


# ---- argument checks --------------------------------------------------------------------------


def _describe(value: object) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def has_lone_surrogate(text: str) -> bool:
    """True if ``text`` holds a lone UTF-16 surrogate (not encodable as UTF-8). O(len)."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# vLLM's own limits on salts (vllm.entrypoints.generate.base.protocol.validate_cache_salt):
# the in-process engine does not check them, cache backends keyed by the salt rely on them.
_MAX_SALT_LENGTH = 128
_FORBIDDEN_SALT_CHARS = frozenset("@/\\\x00")


def validate_cache_salt(cache_salt: object) -> CacheSalt | None:
    """``cache_salt`` as a :data:`~craft_rag.types.CacheSalt` (``None`` stays ``None``).
    ``ValueError`` unless it is a non-empty string of valid Unicode, at most 128 characters,
    without ``@``, ``/``, ``\\`` or NUL (vLLM's rules). O(len)."""
    if cache_salt is None:
        return None
    # A salt is a tenant's key to its cache namespace: messages describe it, never quote it.
    if not isinstance(cache_salt, str) or not cache_salt:
        got = "an empty string" if cache_salt == "" else f"a {type(cache_salt).__name__}"
        msg = f"cache_salt must be a non-empty string or None, got {got}"
        raise ValueError(msg)
    if has_lone_surrogate(cache_salt):  # not UTF-8: no namespace digest, no JSON for a server
        msg = (
            "cache_salt holds a lone surrogate (not valid Unicode, cannot be encoded as UTF-8; "
            "not shown: a salt is a tenant's key)"
        )
        raise ValueError(msg)
    if len(cache_salt) > _MAX_SALT_LENGTH or any(c in _FORBIDDEN_SALT_CHARS for c in cache_salt):
        msg = (
            f"cache_salt must be at most {_MAX_SALT_LENGTH} characters without '@', '/', '\\' "
            f"or NUL (vLLM's rules), got one of {len(cache_salt)} characters (not shown: a salt "
            "is a tenant's key); hash the tenant id if needed"
        )
        raise ValueError(msg)
    return CacheSalt(cache_salt)


def check_text(value: object, name: str, *, nonempty: bool = False) -> str:
    """``value`` if it is a ``str`` of valid Unicode (non-empty when asked). O(len)."""
    if not isinstance(value, str):
        msg = f"{name}: must be a string, got {_describe(value)}"
        raise ValueError(msg)
    if nonempty and not value:
        msg = f"{name}: must be a non-empty string"
        raise ValueError(msg)
    if has_lone_surrogate(value):
        msg = (
            f"{name}: holds a lone surrogate (not valid Unicode, cannot be encoded as UTF-8); "
            "decode the source text with errors='replace'"
        )
        raise ValueError(msg)
    return value


def check_int(
    value: object,
    name: str,
    *,
    minimum: int | None = None,
    maximum: int = MAX_INT,
) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) within ``[minimum, maximum]``."""
    if not isinstance(value, int) or isinstance(value, bool):
        msg = f"{name}: must be an int, got {_describe(value)}"
        raise ValueError(msg)
    if minimum is not None and value < minimum:
        msg = f"{name}: must be >= {minimum}, got {value}"
        raise ValueError(msg)
    if value > maximum:
        msg = f"{name}: must be <= {maximum}, got {_describe(value)}"
        raise ValueError(msg)
    return value


def check_optional_int(
    value: object, name: str, *, minimum: int | None = None, none_means: str = "unset"
) -> int | None:
    """``None`` or :func:`check_int`; the message says what ``None`` means."""
    if value is None:
        return None
    try:
        return check_int(value, name, minimum=minimum)
    except ValueError as exc:
        msg = f"{exc} (or None: {none_means})"
        raise ValueError(msg) from None


def check_bool(value: object, name: str) -> bool:
    """``value`` if it is exactly ``True`` or ``False`` (not ``"no"``, ``0`` or ``None``)."""
    if not isinstance(value, bool):
        msg = f"{name}: must be True or False, got {_describe(value)}"
        raise ValueError(msg)
    return value


def check_number(
    value: object,
    name: str,
    *,
    positive: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
) -> float:
    """``value`` as a finite ``float`` if it is an ``int`` or ``float`` (not a ``bool``/``str``)
    within the bounds. The one check for every float setting: NaN passes every ``<``/``>``
    test, so a range check alone lets it through (and a NaN weight makes every cost NaN)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        msg = f"{name}: must be a number, got {_describe(value)}"
        raise ValueError(msg)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        msg = f"{name}: must be a finite number, got {_describe(value)}"
        raise ValueError(msg)
    if positive and number <= 0:
        msg = f"{name}: must be > 0, got {value!r}"
        raise ValueError(msg)
    if minimum is not None and number < minimum:
        msg = f"{name}: must be >= {minimum}, got {value!r}"
        raise ValueError(msg)
    if maximum is not None and number > maximum:
        msg = f"{name}: must be <= {maximum}, got {value!r}"
        raise ValueError(msg)
    return number


def check_optional_number(
    value: object,
    name: str,
    *,
    positive: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
    none_means: str = "unset",
) -> float | None:
    """``None`` or :func:`check_number`; the message says what ``None`` means."""
    if value is None:
        return None
    try:
        return check_number(value, name, positive=positive, minimum=minimum, maximum=maximum)
    except ValueError as exc:
        msg = f"{exc} (or None: {none_means})"
        raise ValueError(msg) from None


class _Named(Protocol):
    name: str


_N = TypeVar("_N", bound=_Named)


def registry_by_name(*policies: type[_N]) -> dict[str, type[_N]]:
    """A policy registry (for :func:`from_registry`): each class under its own ``name``, in the
    given order, so a key cannot disagree with the name its objects report. ``ValueError``
    for two classes of one name. Built once, at import. O(n)."""
    registry: dict[str, type[_N]] = {}
    for policy in policies:
        if policy.name in registry:
            msg = f"{policy.__name__} and {registry[policy.name].__name__} share {policy.name!r}"
            raise ValueError(msg)
        registry[policy.name] = policy
    return registry


def from_registry(registry: Mapping[str, Callable[[], _T]], name: str, what: str) -> _T:
    """A new object of the policy registered as ``name`` (one call of its factory);
    ``ValueError`` naming ``what`` and the valid names for any other name, an unhashable one
    included. O(1); O(n log n) on error (the names are sorted for the message)."""
    try:
        return registry[name]()
    except (KeyError, TypeError):  # TypeError: an unhashable name
        msg = f"unknown {what} {name!r}; choose one of {sorted(registry)}"
        raise ValueError(msg) from None


def validate_conversation_id(value: object, name: str = "conversation_id") -> ConversationId | None:
    """The one rule for conversation ids, used by the core and every integration.

    ``None`` means "no conversation" (no dedup, every turn is a first turn); anything else must
    be a non-empty ``str`` of valid Unicode. Ints, bools, bytes and empty strings are refused
    (``0`` and ``""`` used to mean "none" in one adapter and a real id in another).
    """
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        msg = (
            f"{name}: must be a non-empty string, or None for no conversation, got "
            f"{_describe(value)}; pass str(your_id) if your ids are numbers"
        )
        raise ValueError(msg)
    check_text(value, name)
    return ConversationId(value)


def materialise(items: object, name: str) -> tuple[Any, ...]:
    """``items`` as a tuple, read exactly once (generators and other one-shot iterables are not
    lost). ``ValueError`` for a non-iterable, a ``str``/``bytes`` or a mapping (almost always a
    caller mistake: one item instead of a list of items). O(len)."""
    if isinstance(items, (str, bytes, bytearray, Mapping)):
        msg = f"{name}: must be a list (or other iterable) of items, got {_describe(items)}"
        raise ValueError(msg)
    if not isinstance(items, Iterable):
        msg = f"{name}: must be a list (or other iterable) of items, got {_describe(items)}"
        raise ValueError(msg)
    return tuple(items)


# ---- state-file checks ------------------------------------------------------------------------


def state_path(parent: str, key: str | int) -> str:
    """The JSON path of ``key`` under ``parent`` (``"a.b"``, ``"a[3]"``)."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def state_error(path: str, problem: str) -> ValueError:
    """The one error a bad state file raises: ``"<json path>: <problem>"``."""
    return ValueError(f"{path or '<top level>'}: {problem}")


def state_dict(
    value: object,
    path: str,
    *,
    required: Collection[str] = (),
    optional: Collection[str] = (),
) -> dict[str, Any]:
    """``value`` if it is a JSON object holding every ``required`` key and no unknown key."""
    if not isinstance(value, dict):
        raise state_error(path, f"must be an object, got {_describe(value)}")
    missing = [k for k in required if k not in value]
    if missing:
        raise state_error(path, f"missing field {missing[0]!r}")
    known = set(required) | set(optional)
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise state_error(
            path, f"unknown field {unknown[0]!r} (this version knows {sorted(known)})"
        )
    return value


def state_format(value: object, path: str, expected: str, what: str) -> dict[str, Any]:
    """``value`` if it is an object whose ``format`` is ``expected``."""
    if not isinstance(value, dict) or value.get("format") != expected:
        where = f"{path}: " if path else ""
        msg = f"{where}not a craft-rag {what} (expected format {expected!r})"
        raise ValueError(msg)
    return value


def state_list(value: object, path: str, *, max_len: int | None = None) -> list[Any]:
    """``value`` if it is a JSON array (of at most ``max_len`` items)."""
    if not isinstance(value, list):
        raise state_error(path, f"must be an array, got {_describe(value)}")
    if max_len is not None and len(value) > max_len:
        raise state_error(path, f"has {len(value)} items, more than the bound {max_len}")
    return value


def state_int(
    value: object, path: str, *, minimum: int | None = None, maximum: int = MAX_INT
) -> int:
    """:func:`check_int` with the JSON path as the name."""
    try:
        return check_int(value, "", minimum=minimum, maximum=maximum)
    except ValueError as exc:
        raise state_error(path, str(exc).removeprefix(": ")) from None


def state_number(value: object, path: str, *, positive: bool = False) -> float:
    """:func:`check_number` with the JSON path as the name."""
    try:
        return check_number(value, "", positive=positive)
    except ValueError as exc:
        raise state_error(path, str(exc).removeprefix(": ")) from None


def state_str(value: object, path: str) -> str:
    """A non-empty string of valid Unicode."""
    try:
        return check_text(value, "", nonempty=True)
    except ValueError as exc:
        raise state_error(path, str(exc).removeprefix(": ")) from None


def state_keys(value: object, path: str) -> tuple[str, ...]:
    """An array of distinct non-empty strings (a request's or a turn's chunk keys). O(len)."""
    items = state_list(value, path)
    keys = tuple(state_str(item, state_path(path, i)) for i, item in enumerate(items))
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        for i, key in enumerate(keys):
            if key in seen:
                raise state_error(state_path(path, i), f"repeats chunk key {key!r}")
            seen.add(key)
    return keys
