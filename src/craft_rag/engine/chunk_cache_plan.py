"""The per-chunk plan of a RAG request with chunk-caches on: exact prefix, chunk-cache + fix, or
compute, and whether to send ``chunk`` spans at all.

Pure (no vLLM, no torch, no clock): :class:`ChunkCachePlanner` reads a rendered prompt's chunk
spans, the CP-Tree's predicted exact prefix and its own :class:`ChunkRecord`, and returns a
:class:`ChunkCachePlan`; the RAG turn (:mod:`craft_rag.engine.rag_turn`) sends the plan's
``craft_approx`` request (:mod:`craft_rag.kvtiers.approx_params`) under a request-scoped salt,
or nothing.

**Per chunk**, in prompt order (CRAFT's order already puts the exact-prefix chunks first):

- *exact*: inside the predicted exact prefix (the plan's ``matched_tokens``), up to the first
  chunk the record says was last sent as a chunk span: such a request runs under a
  request-scoped salt and leaves no exact blocks behind, so the CP-Tree's prediction past it
  is not trusted;
- *fixed*: a chunk the record holds as sent before in a chunk-span request of this tenant (the
  connector then holds a chunk-cache of it: re-rotated, ``fraction`` of it recomputed);
- *compute*: the rest (new chunks; with spans sent, the connector computes and stores them).

**When spans are sent.** A request with a fixable chunk past the exact prefix is sent as
``chunk`` spans over all its chunks (the connector loads the exact prefix from the KV tiers
first and clips the spans there) when the cost model below predicts it cheaper than exact
serving. A request with nothing fixable is served exactly under its own salt (its pool prefix
stays usable by later requests), except a *cold* one (no exact chunk predicted) when
``seed_cold`` is on: it is sent as spans so that its chunks enter the connector's store
(computed in full: exact values, ``approximate`` stays false). Without seeding, no chunk
would ever enter the store: the connector stores chunks only from chunk-span requests.

**Order.** Among the chunks past the exact prefix, fixable ones should come before new ones
(Cache-Craft + CRAFT's synergy). CRAFT's tree order sorts that tail by access frequency, ties
by retriever rank; a chunk sent before has a count >= 1 and a new one 0, so fixable chunks
come first already. :meth:`ChunkCachePlanner.fixable_first` moves them ahead in the
retriever's order too (stable), which decides the ties; a plan is never reordered after
planning (the planner refuses an altered plan).

**Cost model** (token-equivalents of vLLM prefill, not fitted on this engine: the constants
are stated, not measured). Exact serving computes every token past the exact prefix.
Spans cost ``CONNECTOR_TOKEN_COST x (fraction x fixable tokens + new chunk tokens)`` for the
connector's recomputation, ``RANK_TOKEN_COST x fixable tokens`` for ranking (kv_deviation
runs two of the model's layers over every cached token: 2/30 of a prefill for SmolLM2's 30
layers), plus the tokens after the last chunk (vLLM computes them). ``alpha`` settings are
priced at ``fraction`` 0.3 (their count depends on attention the engine does not see).

**Record** (:class:`ChunkRecord`): an approximation of the connector's store, per tenant salt,
bounded in entries (the store is bounded in bytes and may have evicted a chunk the record
still holds: the connector then recomputes that chunk in full, correct but slower).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from craft_rag.kvtiers.approx_params import APPROX_PARAMS_KEY, CHUNK_SOURCE
from craft_rag.kvtiers.chunk_cache_settings import ChunkCacheSettings
from craft_rag.types import ChunkKey

__all__ = [
    "COMPUTE",
    "CONNECTOR_TOKEN_COST",
    "EXACT",
    "FIXED",
    "RANK_TOKEN_COST",
    "ChunkCachePlan",
    "ChunkCachePlanner",
    "ChunkNote",
    "ChunkRecord",
]

EXACT = "exact"
FIXED = "fixed"
COMPUTE = "compute"

CONNECTOR_TOKEN_COST = 1.0
"""A token the connector computes, in vLLM prefill tokens (assumed equal; not fitted)."""
RANK_TOKEN_COST = 2 / 30
"""Ranking one cached token by kv_deviation: two of 30 layers (SmolLM2-135M)."""
ALPHA_FRACTION = 0.3
"""The share of a reused chunk priced as recomputed under an ``alpha`` setting."""

_T = TypeVar("_T")


@dataclass(slots=True)
class ChunkNote:
    """What the engine knows of one chunk in one tenant. ``cached``: it was in a chunk-span
    request, so the connector computed or fixed it and (bounds allowing) holds a chunk-cache;
    ``exact_last``: its last send was served exactly (normal salt), so its blocks may be an
    exact prefix hit. Owned by its :class:`ChunkRecord`."""

    cached: bool
    exact_last: bool


class ChunkRecord:
    """Chunk keys the engine sent, per tenant salt, least recently sent dropped first beyond
    ``max_chunks`` entries. Not thread-safe: its :class:`ChunkCachePlanner`'s lock guards it
    (RAG turns start on their callers' threads). Invariant: ``len(self) <= max_chunks``.
    O(1) per key."""

    def __init__(self, max_chunks: int) -> None:
        if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
            msg = f"max_chunks must be an integer >= 1, got {max_chunks!r}"
            raise ValueError(msg)
        self.max_chunks = max_chunks
        self._notes: OrderedDict[tuple[str, ChunkKey], ChunkNote] = OrderedDict()

    def __len__(self) -> int:
        return len(self._notes)

    def get(self, salt: str | None, key: ChunkKey) -> ChunkNote | None:
        """The note of ``key`` under ``salt`` (``None``: never sent, or dropped). Does not
        refresh its recency. O(1)."""
        return self._notes.get((salt or "", key))

    def note(self, salt: str | None, keys: Sequence[ChunkKey], *, spans: bool) -> None:
        """Record that ``keys`` were sent, as chunk spans (``spans=True``: now cached, not
        exact) or exactly (cached as before, exact). Refreshes them; drops the least recently
        sent beyond the bound. O(len(keys))."""
        for key in keys:
            slot = (salt or "", key)
            old = self._notes.pop(slot, None)
            cached = spans or (old is not None and old.cached)
            self._notes[slot] = ChunkNote(cached=cached, exact_last=not spans)
        while len(self._notes) > self.max_chunks:
            self._notes.popitem(last=False)
        self._check_invariants()

    def _check_invariants(self) -> None:
        assert len(self._notes) <= self.max_chunks


@dataclass(frozen=True, slots=True)
class ChunkCachePlan:
    """One request's per-chunk decision. ``routes[i]`` (:data:`EXACT`, :data:`FIXED` or
    :data:`COMPUTE`) is the prompt's chunk ``i``; ``send``: whether ``chunk`` spans go out
    (then ``spans`` are every chunk's span, contiguous); ``reason`` says why, in words;
    ``exact_cost``/``span_cost``: the cost model's two predictions (token-equivalents)."""

    routes: tuple[str, ...]
    send: bool
    reason: str
    spans: tuple[tuple[int, int], ...] = ()
    exact_cost: float = 0.0
    span_cost: float = 0.0

    def params(self, settings: ChunkCacheSettings) -> dict[str, Any]:
        """The ``kv_transfer_params`` to send (``RuntimeError`` when ``send`` is false)."""
        if not self.send:
            msg = "this plan sends nothing; check plan.send first"
            raise RuntimeError(msg)
        spans = [{"start": s, "end": e, "source": CHUNK_SOURCE} for s, e in self.spans]
        return {APPROX_PARAMS_KEY: {"spans": spans, "blend": settings.blend()}}


class ChunkCachePlanner:
    """Decides per chunk (see the module docstring) and owns the engine's :class:`ChunkRecord`.
    Stateless besides the record; thread-safe (one lock around every read and note of it: turns
    start on their callers' threads; nothing slow runs under it)."""

    def __init__(self, settings: ChunkCacheSettings) -> None:
        self.settings = settings
        self.record = ChunkRecord(settings.max_chunks)  # owner: this planner, under _lock
        self._lock = threading.Lock()

    def _fixable(self, salt: str | None, key: ChunkKey) -> bool:
        note = self.record.get(salt, key)
        return note is not None and note.cached

    def fixable_first(
        self, chunks: Sequence[_T], key_of: Callable[[_T], ChunkKey], salt: str | None
    ) -> list[_T]:
        """``chunks`` with the fixable ones first, each group in its given order (stable).
        O(k)."""
        with self._lock:
            marks = [self._fixable(salt, key_of(c)) for c in chunks]
        if all(marks) or not any(marks):
            return list(chunks)
        return [c for c, m in zip(chunks, marks, strict=True) if m] + [
            c for c, m in zip(chunks, marks, strict=True) if not m
        ]

    def plan(
        self,
        keys: Sequence[ChunkKey],
        spans: Sequence[tuple[int, int]],
        predicted_tokens: int | None,
        prompt_tokens: int,
        salt: str | None,
    ) -> ChunkCachePlan:
        """The per-chunk plan of a prompt whose chunk ``i`` is ``keys[i]`` at ``spans[i]``
        (contiguous), ``predicted_tokens`` of it predicted in the exact prefix (``None``: 0).
        Reads the record, changes nothing (call :meth:`sent` once the request is submitted).
        ``ValueError`` when keys and spans disagree. O(k)."""
        if len(keys) != len(spans):
            msg = f"{len(keys)} chunk keys for {len(spans)} chunk spans"
            raise ValueError(msg)
        if not keys:
            return ChunkCachePlan((), False, "no chunks")
        if spans[-1][1] > prompt_tokens - 1:  # vLLM always computes the last prompt token
            return ChunkCachePlan((COMPUTE,) * len(keys), False, "chunks reach the last token")
        predicted = predicted_tokens or 0
        routes: list[str] = []
        trusted = True
        with self._lock:
            notes = [self.record.get(salt, key) for key in keys]
        for note, (_, end) in zip(notes, spans, strict=True):
            if trusted and end <= predicted and (note is None or note.exact_last):
                routes.append(EXACT)
                continue
            trusted = False
            routes.append(FIXED if note is not None and note.cached else COMPUTE)
        exact_end = max((e for r, (_, e) in zip(routes, spans, strict=True) if r == EXACT),
                        default=spans[0][0])
        fixed = sum(e - s for r, (s, e) in zip(routes, spans, strict=True) if r == FIXED)
        new = sum(e - s for r, (s, e) in zip(routes, spans, strict=True) if r == COMPUTE)
        tail = max(0, prompt_tokens - spans[-1][1])
        exact_cost = float(max(0, prompt_tokens - exact_end))
        fraction = self.settings.fraction
        share = fraction if fraction is not None else ALPHA_FRACTION
        span_cost = (CONNECTOR_TOKEN_COST * (share * fixed + new) + RANK_TOKEN_COST * fixed
                     + tail)
        all_spans = tuple(spans)
        done = tuple(routes)
        if fixed == 0:
            if EXACT not in routes and self.settings.seed_cold:
                return ChunkCachePlan(done, True, "cold: sent as chunk spans to fill the store",
                                      all_spans, exact_cost, span_cost)
            return ChunkCachePlan(done, False, "nothing fixable", (), exact_cost, span_cost)
        if span_cost >= exact_cost:
            return ChunkCachePlan(done, False, "exact serving predicted cheaper", (),
                                  exact_cost, span_cost)
        return ChunkCachePlan(done, True, "chunk-caches predicted cheaper", all_spans,
                              exact_cost, span_cost)

    def sent(self, salt: str | None, keys: Sequence[ChunkKey], plan: ChunkCachePlan) -> None:
        """Record a submitted request's chunks (as spans when ``plan.send``). O(k)."""
        with self._lock:
            self.record.note(salt, keys, spans=plan.send)
