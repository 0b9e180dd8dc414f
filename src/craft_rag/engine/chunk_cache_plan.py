"""The per-chunk plan of a RAG request with chunk-caches on (v2): exact prefix, chunk-cache +
fix, or compute; whether to send ``chunk`` spans, over which chunks; and which chunks an exact
request lists for the connector to keep.

Pure (no vLLM, no torch, no clock): :class:`ChunkCachePlanner` reads a rendered prompt's chunk
spans, the CP-Tree's predicted exact prefix and its own :class:`ChunkRecord`, and returns a
:class:`ChunkCachePlan`; the RAG turn (:mod:`craft_rag.engine.rag_turn`) sends the plan's
:meth:`ChunkCachePlan.params` as ``kv_transfer_params``: a ``craft_approx`` request
(:mod:`craft_rag.kvtiers.approx_params`) under a request-scoped salt, or a ``craft_chunks``
list (:data:`~craft_rag.kvtiers.approx_params.HARVEST_PARAMS_KEY`) under the tenant's own salt,
or nothing.

**Per chunk**, in prompt order (CRAFT's order already puts the exact-prefix chunks first):

- *exact*: inside the predicted exact prefix (the plan's ``matched_tokens``), up to the first
  chunk whose last send the record says was not exact (it was in a span run or after one:
  such a request runs under a request-scoped salt and leaves no exact blocks of it behind, so
  the CP-Tree's prediction past it is not trusted);
- *fixed*: a chunk the record holds as in the connector's store (it was in a span run, or
  harvested from an exact request): the connector re-rotates its chunk-cache and recomputes
  ``fraction`` of it;
- *compute*: the rest (new chunks).

**Span requests.** Spans are sent iff at least one *fixed* chunk lies past the exact prefix
(every fixed chunk does, by the rule above) and the cost model below predicts them cheaper
than exact serving. They cover the chunks from the first one *through the last fixed one*,
contiguous (the connector loads the exact prefix from the KV tiers first and clips the spans
there; new chunks between fixed ones are computed by the connector). The chunks after the last
fixed one are in no span: vLLM computes them with the question. A span request carries no
``craft_chunks`` list.

**Exact requests and harvest.** Every other request is served exactly under the tenant's
salt (its blocks stay an exact prefix for later requests). With ``harvest`` on
(:class:`~craft_rag.kvtiers.chunk_cache_settings.ChunkCacheSettings`) it lists in
``craft_chunks`` every chunk that ends inside its full prompt blocks (``end <= (prompt_tokens
// block_size) x block_size``; chunks are contiguous, so these are a prefix of the chunks),
and the connector keeps each as a chunk-cache variant read back from the exactly computed
blocks (no extra forward): the store fills for free. With ``seed_cold`` on (off by default), a
*cold* request (no exact chunk predicted, nothing fixable) is instead sent as spans over all
its chunks (the connector computes them in full and stores them; the request's blocks are then
no exact prefix for anyone: what v1 did and why it computed more than CRAFT alone).

**Order.** Among the chunks past the exact prefix, fixable ones should come before new ones
(Cache-Craft + CRAFT's synergy): then the span run ends early and vLLM computes the new chunks.
CRAFT's tree order sorts that tail by access frequency, ties by retriever rank; a chunk sent
before has a count >= 1 and a new one 0, so fixable chunks come first already.
:meth:`ChunkCachePlanner.fixable_first` moves them ahead in the retriever's order too
(stable), which decides the ties; a plan is never reordered after planning.

**Cost model** (token-equivalents of vLLM prefill, not fitted on this engine: the constants
are stated, not measured). Exact serving computes every token past the exact prefix
(``exact_cost = prompt_tokens - end of the last exact chunk``, or of the head when none).
Spans cost ``CONNECTOR_TOKEN_COST x (fraction x fixed tokens + new chunk tokens inside the
span run)`` for the connector's recomputation, ``RANK_TOKEN_COST x fixed tokens`` for ranking
(kv_deviation runs two of the model's layers over every cached token: 2/30 of a prefill for
SmolLM2's 30 layers), plus ``prompt_tokens - run end`` (vLLM computes the chunks after the run
and the question). ``alpha`` settings are priced at ``fraction`` 0.3 (their count depends on
attention the engine does not see). With nothing fixable ``span_cost`` prices a run over all
chunks (what a seed would cost).

**Record** (:class:`ChunkRecord`, updated by :meth:`ChunkCachePlanner.sent`): an
approximation of the connector's store and of vLLM's exact blocks, per tenant salt, bounded in
entries (the store is bounded in bytes and may have evicted a chunk the record still holds: the
connector then recomputes that chunk in full, correct but slower). After a span request: the
*exact* chunks keep ``exact_last`` (cached unchanged); the other chunks of the span run become
cached, not exact; the chunks after the run (computed by vLLM under the request-scoped salt)
become not exact, cached unchanged. After an exact request: every chunk is exact; with harvest
the listed ones become cached once it has finished (:meth:`ChunkCachePlanner.finished`, from
the turn's commit: the connector reads them back only then).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from craft_rag.kvtiers.approx_params import (
    APPROX_PARAMS_KEY,
    CHUNK_SOURCE,
    HARVEST_PARAMS_KEY,
)
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
    """What the engine knows of one chunk in one tenant. ``cached``: the connector should hold
    a chunk-cache of it (it was in a chunk-span run, or harvested from an exact request);
    ``exact_last``: its last send left exact blocks of it under the tenant salt (an exact
    request, or the exact prefix of a span request), so the CP-Tree's prefix prediction over
    it is trusted. Owned by its :class:`ChunkRecord`."""

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

    def note(
        self,
        salt: str | None,
        keys: Sequence[ChunkKey],
        *,
        exact_last: bool,
        cached: bool | None = None,
    ) -> None:
        """Record that ``keys`` were sent: each note's ``exact_last`` is set, and ``cached``
        too unless ``None`` (then kept; ``False`` for a key not held). Refreshes them, in the
        given order; drops the least recently sent beyond the bound. O(len(keys))."""
        for key in keys:
            slot = (salt or "", key)
            old = self._notes.pop(slot, None)
            held = cached if cached is not None else (old is not None and old.cached)
            self._notes[slot] = ChunkNote(cached=held, exact_last=exact_last)
        while len(self._notes) > self.max_chunks:
            self._notes.popitem(last=False)
        self._check_invariants()

    def _check_invariants(self) -> None:
        assert len(self._notes) <= self.max_chunks


@dataclass(frozen=True, slots=True)
class ChunkCachePlan:
    """One request's per-chunk decision. ``routes[i]`` (:data:`EXACT`, :data:`FIXED` or
    :data:`COMPUTE`) is the prompt's chunk ``i``; ``send``: whether ``chunk`` spans go out,
    then ``spans`` are the spans of chunks ``0 .. len(spans) - 1`` (contiguous, through the
    last fixed chunk; every chunk for a cold seed); ``harvest_spans``: for an exact request
    with harvest on, the spans of the chunks it lists in ``craft_chunks`` (chunks
    ``0 .. len(harvest_spans) - 1``, each ending inside the full prompt blocks), empty for a
    span request; ``reason`` says why, in words; ``exact_cost``/``span_cost``: the cost model's
    two predictions (token-equivalents)."""

    routes: tuple[str, ...]
    send: bool
    reason: str
    spans: tuple[tuple[int, int], ...] = ()
    exact_cost: float = 0.0
    span_cost: float = 0.0
    harvest_spans: tuple[tuple[int, int], ...] = ()

    def params(self, settings: ChunkCacheSettings) -> dict[str, Any]:
        """The ``kv_transfer_params`` to send: the ``craft_approx`` chunk spans (with
        ``settings``' blend) for a span request, the ``craft_chunks`` list for an exact request
        with harvest spans, ``{}`` when there is nothing to send. O(chunks)."""
        if self.send:
            spans = [{"start": s, "end": e, "source": CHUNK_SOURCE} for s, e in self.spans]
            return {APPROX_PARAMS_KEY: {"spans": spans, "blend": settings.blend()}}
        if self.harvest_spans:
            return {HARVEST_PARAMS_KEY: {"spans": [[s, e] for s, e in self.harvest_spans]}}
        return {}


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

    def _harvest_spans(
        self, spans: Sequence[tuple[int, int]], prompt_tokens: int, block_size: int
    ) -> tuple[tuple[int, int], ...]:
        """The chunks an exact request lists (harvest on): those ending inside the full prompt
        blocks, a prefix of the (contiguous) chunks. O(k)."""
        if not self.settings.harvest:
            return ()
        bound = (prompt_tokens // block_size) * block_size
        out: list[tuple[int, int]] = []
        for start, end in spans:
            if end > bound:
                break
            out.append((start, end))
        return tuple(out)

    def plan(
        self,
        keys: Sequence[ChunkKey],
        spans: Sequence[tuple[int, int]],
        predicted_tokens: int | None,
        prompt_tokens: int,
        salt: str | None,
        *,
        block_size: int,
    ) -> ChunkCachePlan:
        """The per-chunk plan of a prompt whose chunk ``i`` is ``keys[i]`` at ``spans[i]``
        (contiguous), ``predicted_tokens`` of it predicted in the exact prefix (``None``: 0),
        in an engine of ``block_size``-token KV blocks. Reads the record, changes nothing (call
        :meth:`sent` once the request is submitted). ``ValueError`` when keys and spans
        disagree or ``block_size`` is not an integer >= 1. O(k)."""
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            msg = f"block_size must be an integer >= 1, got {block_size!r}"
            raise ValueError(msg)
        if len(keys) != len(spans):
            msg = f"{len(keys)} chunk keys for {len(spans)} chunk spans"
            raise ValueError(msg)
        if not keys:
            return ChunkCachePlan((), False, "no chunks")
        harvest = self._harvest_spans(spans, prompt_tokens, block_size)
        if spans[-1][1] > prompt_tokens - 1:  # vLLM always computes the last prompt token
            return ChunkCachePlan((COMPUTE,) * len(keys), False, "chunks reach the last token",
                                  harvest_spans=harvest)
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
        done = tuple(routes)
        exact_end = max((e for r, (_, e) in zip(done, spans, strict=True) if r == EXACT),
                        default=spans[0][0])
        exact_cost = float(max(0, prompt_tokens - exact_end))
        # The span run: chunks 0 .. run - 1, through the last fixed one (every chunk if none).
        run = max((i + 1 for i, r in enumerate(done) if r == FIXED), default=len(done))
        fixed = sum(e - s for r, (s, e) in zip(done, spans, strict=True) if r == FIXED)
        new = sum(e - s for r, (s, e) in zip(done[:run], spans[:run], strict=True)
                  if r == COMPUTE)
        fraction = self.settings.fraction
        share = fraction if fraction is not None else ALPHA_FRACTION
        span_cost = (CONNECTOR_TOKEN_COST * (share * fixed + new) + RANK_TOKEN_COST * fixed
                     + max(0, prompt_tokens - spans[run - 1][1]))
        if fixed == 0:
            if EXACT not in done and self.settings.seed_cold:
                return ChunkCachePlan(done, True, "cold: sent as chunk spans to fill the store",
                                      tuple(spans), exact_cost, span_cost)
            return ChunkCachePlan(done, False, "nothing fixable", (), exact_cost, span_cost,
                                  harvest)
        if span_cost >= exact_cost:
            return ChunkCachePlan(done, False, "exact serving predicted cheaper", (),
                                  exact_cost, span_cost, harvest)
        return ChunkCachePlan(done, True, "chunk-caches predicted cheaper", tuple(spans[:run]),
                              exact_cost, span_cost)

    def sent(self, salt: str | None, keys: Sequence[ChunkKey], plan: ChunkCachePlan) -> None:
        """Record a submitted request's chunks (see the module docstring's "Record").
        ``ValueError`` when ``keys`` are not the plan's chunks' count. O(k)."""
        if len(keys) != len(plan.routes):
            msg = f"{len(keys)} chunk keys for a plan of {len(plan.routes)} chunks"
            raise ValueError(msg)
        with self._lock:
            if plan.send:
                exact = plan.routes.count(EXACT)  # a prefix of the routes, inside the run
                run = len(plan.spans)
                self.record.note(salt, keys[:exact], exact_last=True)
                self.record.note(salt, keys[exact:run], exact_last=False, cached=True)
                self.record.note(salt, keys[run:], exact_last=False)
            else:  # listed chunks become cached only when the request finished (finished())
                self.record.note(salt, keys, exact_last=True)

    def finished(self, salt: str | None, keys: Sequence[ChunkKey], plan: ChunkCachePlan) -> None:
        """Record that a request served exactly has finished: the chunks it listed for
        harvest are now read back by the connector (it reads them once the request finished,
        at its next scheduling call), so they become cached. Until then a concurrent request
        does not count on them (the connector would compute them in full). ``ValueError``
        when ``keys`` are not the plan's chunks' count. O(k)."""
        if len(keys) != len(plan.routes):
            msg = f"{len(keys)} chunk keys for a plan of {len(plan.routes)} chunks"
            raise ValueError(msg)
        if plan.send or not plan.harvest_spans:
            return
        with self._lock:
            self.record.note(salt, keys[: len(plan.harvest_spans)], exact_last=True,
                             cached=True)
