"""How a request asks for approximate KV, the isolation salt it must carry, and what it reports.

Framework-free (no vLLM, no torch): the engine side builds requests with it and
:class:`craft_rag.kvtiers.approx_connector.CraftApproxConnector` checks them with it.

A request asks in vLLM's per-request ``kv_transfer_params`` (in-process
``SamplingParams(extra_args={"kv_transfer_params": ...})``; the OpenAI body's
``kv_transfer_params`` under a server)::

    {"craft_approx": {"model": "/path/or/name",            # optional; must be the served model
                      "spans": [{"start": 96, "end": 240, "source": "hf_prefill"},
                                {"start": 240, "end": 400, "source": "noisy",
                                 "scale": 2.0}]}}        # source-specific fields pass through

or, for chunks served from chunk-caches with selective recomputation (every span a chunk,
everything before the first one the exact head; ``blend`` optional, defaults shown)::

    {"craft_approx": {"spans": [{"start": 96, "end": 240, "source": "chunk"},
                                {"start": 240, "end": 400, "source": "chunk"}],
                      "blend": {"rule": "kv_deviation", "fraction": 0.3}}}

**Isolation rule.** vLLM registers every block a request holds in its prefix cache under the
hash of the block's tokens *and the request's* ``cache_salt``; KV loaded by a connector is
registered the same way. Approximate KV must never become another request's exact prefix hit,
so a request is served approximate KV only when its ``cache_salt`` is request-scoped
(:func:`request_scoped_salt`: a fresh nonce, then the tenant's own salt). No other request
can carry that salt, so none of its blocks can be hit by anyone else. As a consequence its
exact prefix cannot come from vLLM's pool (keyed under other salts): the connector serves it
from the KV tiers, keyed under the tenant salt (:func:`tenant_salt`), which the tiers'
write-through fills with every block computed exactly. Nothing computed for such a request
is written to the tiers (its blocks after the first approximate token are approximate, and
the ones before came from the tiers already).

Every request that asked reports, in ``RequestOutput.kv_transfer_params["craft_reuse"]``, its
prompt tokens by origin (:class:`ReuseCounts`): ``exact`` (pool or tier hit), ``fixed``
(approximate KV from a chunk-cache, re-rotated and not recomputed), ``recomputed`` (computed by
the connector's own model copy: selected tokens, chunks without a cache, a head it computed)
and ``computed`` (by vLLM), plus ``refused``: why approximate KV was not used (``None`` when it
was). A refused request is computed normally: wrong KV is never the fallback.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "APPROX_PARAMS_KEY",
    "APPROX_SALT_PREFIX",
    "BLEND_RULES",
    "CHUNK_SOURCE",
    "HARVEST_PARAMS_KEY",
    "REUSE_PARAMS_KEY",
    "ApproxRequest",
    "BlendParams",
    "KVSpan",
    "ReuseCounts",
    "is_request_scoped",
    "parse_approx",
    "parse_harvest",
    "request_scoped_salt",
    "reuse_counts_of",
    "tenant_salt",
]

APPROX_PARAMS_KEY = "craft_approx"
"""Key of the approximate-KV request in ``kv_transfer_params``."""

REUSE_PARAMS_KEY = "craft_reuse"
"""Key of the per-request :class:`ReuseCounts` in the finished request's ``kv_transfer_params``."""

HARVEST_PARAMS_KEY = "craft_chunks"
"""Key of an *exact* request's chunk spans in ``kv_transfer_params``: ``{"spans": [[start, end],
...]}`` (sorted, non-overlapping, inside the prompt). With chunk-caches on, the connector keeps
each listed chunk that lies in the request's full prompt blocks as a chunk-cache variant, read
back from the exactly computed blocks (:func:`parse_harvest`; no extra forward). A
request-scoped request's list is ignored (its blocks are not exact)."""

CHUNK_SOURCE = "chunk"
"""The span source that names a chunk to serve from chunk-caches with selective recomputation
(:mod:`craft_rag.kvtiers.blend_source`); a request's spans are either all ``chunk`` or none."""

BLEND_RULES = ("cci", "kv_deviation", "random")
"""Token selection rules (``craft_rag.chunkcache.selection.RANKERS``, named here so this module
stays framework-free; a test keeps the two equal)."""

DEFAULT_BLEND_RULE = "kv_deviation"
DEFAULT_BLEND_FRACTION = 0.3

APPROX_SALT_PREFIX = "craft-approx:"
_NONCE_HEX = 32
_MAX_SPANS = 4096
_SPAN_KEYS = frozenset({"start", "end", "source"})


def request_scoped_salt(tenant: str | None = None, nonce: str | None = None) -> str:
    """A ``cache_salt`` no other request carries: the prefix, a 128-bit random nonce (or
    ``nonce``, 32 lowercase hex digits, for reproducible tests), ``|`` and the tenant's salt
    (empty for none). ``ValueError`` for a malformed nonce."""
    nonce = secrets.token_hex(_NONCE_HEX // 2) if nonce is None else nonce
    if len(nonce) != _NONCE_HEX or any(c not in "0123456789abcdef" for c in nonce):
        msg = f"nonce must be {_NONCE_HEX} lowercase hex digits; got {nonce!r}"
        raise ValueError(msg)
    return f"{APPROX_SALT_PREFIX}{nonce}|{tenant or ''}"


def is_request_scoped(salt: str | None) -> bool:
    """Whether ``salt`` has the form :func:`request_scoped_salt` makes."""
    if salt is None or not salt.startswith(APPROX_SALT_PREFIX):
        return False
    rest = salt[len(APPROX_SALT_PREFIX) :]
    nonce, sep, _ = rest.partition("|")
    return bool(sep) and len(nonce) == _NONCE_HEX and all(c in "0123456789abcdef" for c in nonce)


def tenant_salt(salt: str | None) -> str | None:
    """The salt exact KV of this request is keyed under: the tenant part of a request-scoped
    salt (``None`` when empty), any other salt unchanged."""
    if not is_request_scoped(salt):
        return salt
    assert salt is not None
    tenant = salt.partition("|")[2]
    return tenant or None


@dataclass(frozen=True, slots=True)
class KVSpan:
    """Prompt positions ``[start, end)`` whose KV a named source provides; ``spec`` holds the
    source's own fields (a variant key, options), validated by that source."""

    start: int
    end: int
    source: str
    spec: Mapping[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class BlendParams:
    """How ``chunk`` spans are fixed: rank tokens by ``rule`` (:data:`BLEND_RULES`) and recompute
    ``fraction`` of every cached chunk (``ceil(fraction x |C|)`` tokens), or, with ``alpha``
    set instead, Cache-Craft's CFO count ``ceil(min(1, alpha x CCI x (1 - beta')) x |C|)``.
    Invariant: exactly one of ``fraction`` and ``alpha`` is set; ``0 <= fraction <= 1``,
    ``alpha >= 0`` and finite."""

    rule: str = DEFAULT_BLEND_RULE
    fraction: float | None = DEFAULT_BLEND_FRACTION
    alpha: float | None = None


def _number(value: object, what: str, upper: float | None) -> float:
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or value < 0 or (upper is not None and value > upper)):
        bound = f"in [0, {upper}]" if upper is not None else ">= 0 and finite"
        msg = f"{what} must be a number {bound}; got {value!r:.60}"
        raise ValueError(msg)
    return float(value)


def parse_blend(raw: object) -> BlendParams:
    """The ``blend`` field of a ``craft_approx`` request (``None``: the defaults,
    ``kv_deviation`` at 30%). ``ValueError`` naming what to fix."""
    if raw is None:
        return BlendParams()
    if not isinstance(raw, Mapping) or not set(raw) <= {"rule", "fraction", "alpha"}:
        msg = f"{APPROX_PARAMS_KEY}.blend must be a mapping of 'rule', 'fraction' or 'alpha'"
        raise ValueError(msg)
    rule = raw.get("rule", DEFAULT_BLEND_RULE)
    if not isinstance(rule, str) or rule not in BLEND_RULES:
        msg = f"blend rule {rule!r:.60} unknown; valid: {list(BLEND_RULES)}"
        raise ValueError(msg)
    if "fraction" in raw and "alpha" in raw:
        msg = "blend takes 'fraction' (fixed share) or 'alpha' (Cache-Craft CFO), not both"
        raise ValueError(msg)
    if "alpha" in raw:
        return BlendParams(rule, None, _number(raw["alpha"], "blend alpha", None))
    fraction = _number(raw.get("fraction", DEFAULT_BLEND_FRACTION), "blend fraction", 1.0)
    return BlendParams(rule, fraction, None)


@dataclass(frozen=True, slots=True)
class ApproxRequest:
    """A validated ``craft_approx`` request. Invariants: spans are sorted, non-empty,
    non-overlapping and contiguous (each starts where the previous ends), and the last ends
    before the last prompt token (vLLM always computes that one)."""

    spans: tuple[KVSpan, ...]
    model: str | None = None
    blend: BlendParams | None = None
    """Set (defaults filled in) exactly when the spans are ``chunk`` spans."""

    @property
    def start(self) -> int:
        return self.spans[0].start

    @property
    def end(self) -> int:
        return self.spans[-1].end


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"{what} must be an int; got {value!r:.60}"
        raise ValueError(msg)
    return value


def parse_approx(params: object, prompt_len: int, sources: Collection[str]) -> ApproxRequest | None:
    """The ``craft_approx`` request in ``params`` (a request's ``kv_transfer_params``), or
    ``None`` when it has none. Validated in full: ``ValueError`` (naming what to fix) for any
    malformed entry, an unknown source (valid ones: ``sources``), spans that are unsorted,
    overlapping, not contiguous, outside the prompt or covering its last token. Untrusted
    input: nothing in it is evaluated, and it never names a path. Cost: O(spans)."""
    if not isinstance(params, Mapping):
        return None
    raw = params.get(APPROX_PARAMS_KEY)
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not set(raw) <= {"model", "spans", "blend"}:
        msg = (f"{APPROX_PARAMS_KEY} must be a mapping with 'spans' (and optional 'model', "
               "'blend')")
        raise ValueError(msg)
    model = raw.get("model")
    if model is not None and not isinstance(model, str):
        msg = f"{APPROX_PARAMS_KEY}.model must be a string; got {model!r:.60}"
        raise ValueError(msg)
    items = raw.get("spans")
    if not isinstance(items, list) or not items or len(items) > _MAX_SPANS:
        msg = f"{APPROX_PARAMS_KEY}.spans must be a non-empty list of at most {_MAX_SPANS} spans"
        raise ValueError(msg)
    spans: list[KVSpan] = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping) or not set(item) >= _SPAN_KEYS:
            msg = f"span {i} must be a mapping with {sorted(_SPAN_KEYS)}"
            raise ValueError(msg)
        start, end = _int(item["start"], f"span {i} start"), _int(item["end"], f"span {i} end")
        source = item["source"]
        if not isinstance(source, str) or source not in sources:
            msg = f"span {i}: unknown source {source!r:.60}; valid: {sorted(sources)}"
            raise ValueError(msg)
        if not 0 <= start < end:
            msg = f"span {i}: [{start}, {end}) must be non-empty and start at >= 0"
            raise ValueError(msg)
        if spans and start != spans[-1].end:
            msg = f"span {i} starts at {start}, not where span {i - 1} ends ({spans[-1].end})"
            raise ValueError(msg)
        spec = {k: v for k, v in item.items() if k not in _SPAN_KEYS}
        if source == CHUNK_SOURCE and spec:
            msg = f"span {i}: '{CHUNK_SOURCE}' spans take no other fields; got {sorted(spec)}"
            raise ValueError(msg)
        spans.append(KVSpan(start, end, source, spec))
    if spans[-1].end > prompt_len - 1:
        msg = (
            f"spans end at {spans[-1].end}; they must end before the last prompt token "
            f"(<= {prompt_len - 1})"
        )
        raise ValueError(msg)
    chunked = [s.source == CHUNK_SOURCE for s in spans]
    if any(chunked) and not all(chunked):
        msg = f"'{CHUNK_SOURCE}' spans cannot be mixed with other sources in one request"
        raise ValueError(msg)
    if not any(chunked) and raw.get("blend") is not None:
        msg = f"blend applies to '{CHUNK_SOURCE}' spans only"
        raise ValueError(msg)
    blend = parse_blend(raw.get("blend")) if any(chunked) else None
    return ApproxRequest(tuple(spans), model, blend)


def parse_harvest(params: object, prompt_len: int) -> tuple[tuple[int, int], ...]:
    """The chunk spans of :data:`HARVEST_PARAMS_KEY` in ``params`` (``()`` when absent).
    ``ValueError`` (naming what to fix) for a malformed entry, spans that are empty, unsorted,
    overlapping or outside the prompt, or more than the span bound. Untrusted input: only
    integers are read. O(spans)."""
    if not isinstance(params, Mapping):
        return ()
    raw = params.get(HARVEST_PARAMS_KEY)
    if raw is None:
        return ()
    items = raw.get("spans") if isinstance(raw, Mapping) and set(raw) == {"spans"} else None
    if not isinstance(items, list) or len(items) > _MAX_SPANS:
        msg = (f"{HARVEST_PARAMS_KEY} must be {{'spans': [[start, end], ...]}} with at most "
               f"{_MAX_SPANS} spans")
        raise ValueError(msg)
    spans: list[tuple[int, int]] = []
    for i, item in enumerate(items):
        if not isinstance(item, list | tuple) or len(item) != 2:
            msg = f"{HARVEST_PARAMS_KEY} span {i} must be [start, end]; got {item!r:.60}"
            raise ValueError(msg)
        start = _int(item[0], f"{HARVEST_PARAMS_KEY} span {i} start")
        end = _int(item[1], f"{HARVEST_PARAMS_KEY} span {i} end")
        low = spans[-1][1] if spans else 0
        if not low <= start < end <= prompt_len:
            msg = (f"{HARVEST_PARAMS_KEY} span {i} [{start}, {end}) must be non-empty, inside "
                   f"the prompt of {prompt_len} tokens and start at or after {low}")
            raise ValueError(msg)
        spans.append((start, end))
    return tuple(spans)


@dataclass(slots=True)
class ReuseCounts:
    """Prompt tokens of one request by origin; ``refused`` says why approximate KV was not used
    (``None``: it was, or was not asked for). Owned by the scheduler-role connector until the
    request finishes. Invariant: the four counts sum to the prompt length."""

    exact: int = 0
    fixed: int = 0
    recomputed: int = 0
    computed: int = 0
    refused: str | None = None

    def to_params(self) -> dict[str, Any]:
        return {"exact": self.exact, "fixed": self.fixed, "recomputed": self.recomputed,
                "computed": self.computed, "refused": self.refused}


def reuse_counts_of(params: object, *, prompt_len: int | None = None) -> ReuseCounts | None:
    """The :class:`ReuseCounts` in a finished request's ``kv_transfer_params``; ``None`` when
    absent or malformed (a report never fails a finished request), or when the counts do not
    sum to ``prompt_len`` (when given). O(1)."""
    if not isinstance(params, Mapping):
        return None
    raw = params.get(REUSE_PARAMS_KEY)
    if not isinstance(raw, Mapping) or set(raw) != {"exact", "fixed", "recomputed", "computed",
                                                    "refused"}:
        return None
    counts = [raw[k] for k in ("exact", "fixed", "recomputed", "computed")]
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        return None
    refused = raw["refused"]
    if refused is not None and not isinstance(refused, str):
        return None
    if prompt_len is not None and sum(counts) != prompt_len:
        return None
    exact, fixed, recomputed, computed = counts
    return ReuseCounts(exact, fixed, recomputed, computed, refused)
