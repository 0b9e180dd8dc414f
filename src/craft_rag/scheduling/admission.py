"""Cache-aware admission: which waiting request the engine serves next (RAGCache §5.2).

When requests queue, serving first those whose prompt is mostly cached lowers mean TTFT: they
cost little compute and use their cached blocks before eviction takes them. RAGCache ranks a
waiting request by ``OrderPriority = cached tokens / tokens to compute`` inside a window that
bounds starvation. craft-rag knows the predicted cached tokens before a request is admitted
(the plan's ``matched_tokens``, from the CP-Tree; a conversation's later turn counts its
history: :func:`craft_rag.engine.rag_turn.predicted_cached_tokens`).

**One integer key per request, fixed at arrival.** Request number ``n`` (arrival order, from
0) with predicted cache fraction ``f = cached / prompt`` (``= p / (1 + p)`` for
``p = OrderPriority``; 0 under ``fcfs``) gets::

    key = (n + window) * SCALE - floor(window * SCALE * f)

and the lowest key runs first (ties: the earlier arrival). The same key is the ``priority``
handed to vLLM's priority scheduler (lower runs first, ties by arrival) or ordered by
:class:`AdmissionQueue`, so the library-side queue and vLLM order requests identically.

Why a fixed key and not per-request aging counters: vLLM's priority scheduler has no aging,
so the bound has to live in the key itself. Later arrivals' keys grow by ``SCALE`` per
arrival while ``floor(window * SCALE * f)`` is at most ``window * SCALE``, so an older request
is overtaken only by requests that arrived fewer than ``window`` places after it: aging by
arrival count. Within that distance the cache fraction decides, discounted by arrival distance
(a request ``d`` places later overtakes only with ``f`` larger by more than ``d / window``).

**Invariant (the starvation bound).** For requests ``a`` (arrival ``i``) and ``b`` (arrival
``j > i``), ``key(b) < key(a)`` implies ``j - i < window``: proof ``(j - i) * SCALE <
floor(window*SCALE*f_b) - floor(window*SCALE*f_a) <= window * SCALE``. Hence no request is
served after more than ``window - 1`` requests that arrived after it, whatever the arrival
pattern and predictions; ``window=1`` is exactly FCFS. Keys are >= 0 and grow with arrivals
(int64 holds 9e15 requests at ``SCALE = 1024``).

Costs: :meth:`AdmissionOrder.key` O(1), :class:`AdmissionQueue` push/pop O(log n) (a heap),
remove O(1) (lazy deletion; dead entries are dropped when they reach the top).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from craft_rag.validation import from_registry, registry_by_name

__all__ = [
    "ADMISSION_POLICIES",
    "DEFAULT_ADMISSION",
    "DEFAULT_WINDOW",
    "PRIORITY_SCALE",
    "AdmissionOrder",
    "AdmissionPolicy",
    "AdmissionQueue",
    "Admitted",
    "CacheAware",
    "FirstComeFirstServed",
    "get_admission_policy",
]

DEFAULT_WINDOW = 32
"""RAGCache's reordering window: no request is overtaken by more than ``window - 1`` later ones."""

PRIORITY_SCALE = 1024
"""Key units per arrival: the resolution at which cache fractions are compared (1/1024 of
an arrival place; fractions closer than ``1 / (window * SCALE)`` tie and go FCFS)."""

DEFAULT_ADMISSION = "fcfs"

T = TypeVar("T")


class AdmissionPolicy:
    """How much a waiting request gains from running early. Subclasses set ``name`` and
    override :meth:`order_priority` only; the window and aging are the order's, not theirs."""

    name: str = ""

    def order_priority(self, cached_tokens: int, compute_tokens: int) -> float:
        """RAGCache's ``OrderPriority`` (>= 0; higher runs earlier). ``compute_tokens`` >= 1."""
        raise NotImplementedError


class FirstComeFirstServed(AdmissionPolicy):
    """Arrival order: every request ranks the same, so ties (the earlier arrival) decide."""

    name = "fcfs"

    def order_priority(self, cached_tokens: int, compute_tokens: int) -> float:
        return 0.0


class CacheAware(AdmissionPolicy):
    """RAGCache's ``cached / compute``: mostly-cached, short-to-compute requests first."""

    name = "cache_aware"

    def order_priority(self, cached_tokens: int, compute_tokens: int) -> float:
        return cached_tokens / compute_tokens


ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = registry_by_name(
    FirstComeFirstServed, CacheAware
)


def get_admission_policy(name: str) -> AdmissionPolicy:
    """A policy by name; ``ValueError`` naming the valid ones (``fcfs``, ``cache_aware``)."""
    return from_registry(ADMISSION_POLICIES, name, "admission policy")


class AdmissionOrder:
    """Hands out the admission keys of one engine (see the module docstring for the key and
    its bound). Thread-safe: the arrival number is taken under a lock. O(1) per key."""

    def __init__(
        self, policy: str | AdmissionPolicy = DEFAULT_ADMISSION, window: int = DEFAULT_WINDOW
    ) -> None:
        """``ValueError`` for an unknown policy name or a window that is not an int >= 1."""
        self.policy = get_admission_policy(policy) if isinstance(policy, str) else policy
        if not isinstance(self.policy, AdmissionPolicy):
            msg = f"policy must be a name in {sorted(ADMISSION_POLICIES)} or an AdmissionPolicy"
            raise ValueError(msg)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            msg = f"window must be an int >= 1 (1 is FCFS; RAGCache uses 32), got {window!r}"
            raise ValueError(msg)
        self.window = window
        self._arrivals = itertools.count()  # owner: _lock
        self._lock = threading.Lock()

    def fraction(self, cached_tokens: int, prompt_tokens: int) -> float:
        """The policy's ``OrderPriority`` mapped to ``[0, 1]`` (``p / (1 + p)``: for
        ``cache_aware``, ``cached / prompt``). ``ValueError`` for ``prompt_tokens < 1`` or
        ``cached_tokens`` outside ``[0, prompt_tokens]``; a prediction of the whole prompt
        still computes one token (vLLM always recomputes the last). O(1)."""
        for name, value in (("cached_tokens", cached_tokens), ("prompt_tokens", prompt_tokens)):
            if isinstance(value, bool) or not isinstance(value, int):
                msg = f"{name} must be an int, got {value!r}"
                raise ValueError(msg)
        if prompt_tokens < 1 or not 0 <= cached_tokens <= prompt_tokens:
            msg = (
                f"need 0 <= cached_tokens <= prompt_tokens and prompt_tokens >= 1, got "
                f"cached_tokens={cached_tokens}, prompt_tokens={prompt_tokens}"
            )
            raise ValueError(msg)
        compute = max(1, prompt_tokens - cached_tokens)
        p = self.policy.order_priority(min(cached_tokens, prompt_tokens - 1), compute)
        assert p >= 0 and not math.isnan(p), f"{self.policy.name} returned {p}"
        return 1.0 if math.isinf(p) else p / (1.0 + p)

    def key(self, cached_tokens: int, prompt_tokens: int) -> int:
        """The next arrival's key (lower runs first; also its vLLM ``priority``). Consumes
        one arrival number. Errors as :meth:`fraction` (no number consumed then). O(1)."""
        f = self.fraction(cached_tokens, prompt_tokens)
        with self._lock:
            n = next(self._arrivals)
        return self.key_of(n, f)

    def key_of(self, arrival: int, fraction: float) -> int:
        """The key of arrival number ``arrival`` with cache fraction ``fraction`` in [0, 1]
        (pure; what :meth:`key` computes). O(1)."""
        assert arrival >= 0 and 0.0 <= fraction <= 1.0
        scale = PRIORITY_SCALE
        return (arrival + self.window) * scale - math.floor(self.window * scale * fraction)


@dataclass(frozen=True, slots=True)
class Admitted(Generic[T]):
    """A request leaving the queue: its item, key and how long it was held (seconds)."""

    request_id: str
    item: T
    key: int
    held_s: float


@dataclass(slots=True)
class _Waiting(Generic[T]):
    request_id: str
    item: T
    key: int
    seq: int  # push order: ties between equal keys go FCFS
    arrived_at: float
    live: bool = True  # owner: AdmissionQueue (cleared by remove; the heap drops it lazily)

    def sort_key(self) -> tuple[int, int]:
        return (self.key, self.seq)


class AdmissionQueue(Generic[T]):
    """Requests held by craft-rag until the engine has room, served lowest key first.

    Invariants (:meth:`_check_invariants`): every live entry is in the heap and in the id
    index exactly once; ``len`` counts live entries; the heap holds no more dead entries than
    were removed. Not thread-safe: the owner (a driver) serialises calls. ``clock`` (seconds)
    times how long each request was held.
    """

    def __init__(
        self, order: AdmissionOrder, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.order = order
        self._clock = clock
        self._heap: list[tuple[tuple[int, int], _Waiting[T]]] = []  # owner: this queue
        self._live: dict[str, _Waiting[T]] = {}  # owner: this queue
        self._pushes = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def push(self, request_id: str, item: T, cached_tokens: int, prompt_tokens: int) -> int:
        """Hold a request; returns its key (:meth:`AdmissionOrder.key`). ``ValueError`` for
        bad token counts, ``RuntimeError`` for an id already held. O(log n)."""
        if request_id in self._live:
            msg = f"request {request_id!r} is already waiting for admission"
            raise RuntimeError(msg)
        key = self.order.key(cached_tokens, prompt_tokens)
        self.push_keyed(request_id, item, key)
        return key

    def push_keyed(self, request_id: str, item: T, key: int) -> None:
        """Hold a request under a key already taken from this queue's order. O(log n)."""
        if request_id in self._live:
            msg = f"request {request_id!r} is already waiting for admission"
            raise RuntimeError(msg)
        entry = _Waiting(request_id, item, key, next(self._pushes), self._clock())
        self._live[request_id] = entry
        heapq.heappush(self._heap, (entry.sort_key(), entry))

    def pop(self) -> Admitted[T] | None:
        """The waiting request with the lowest key (``None`` when empty). O(log n) amortised."""
        while self._heap:
            _, entry = heapq.heappop(self._heap)
            if entry.live:
                del self._live[entry.request_id]
                held = max(0.0, self._clock() - entry.arrived_at)
                return Admitted(entry.request_id, entry.item, entry.key, held)
        return None

    def remove(self, request_id: str) -> T | None:
        """Take a waiting request out (aborted before admission); ``None`` if not waiting.
        O(1); its heap slot is dropped when it reaches the top."""
        entry = self._live.pop(request_id, None)
        if entry is None:
            return None
        entry.live = False
        if not self._live:
            self._heap.clear()  # nothing live: drop the dead entries at once
        return entry.item

    def drain(self) -> list[T]:
        """Every waiting item in admission order, emptying the queue. O(n log n)."""
        items = []
        while (admitted := self.pop()) is not None:
            items.append(admitted.item)
        return items

    def _check_invariants(self) -> None:
        live = [e for _, e in self._heap if e.live]
        assert len(live) == len(self._live) == len({id(e) for e in live})
        assert all(self._live.get(e.request_id) is e for e in live)
        assert all(k == e.sort_key() for k, e in self._heap)
        for i in range(1, len(self._heap)):
            assert self._heap[(i - 1) // 2][0] <= self._heap[i][0]
