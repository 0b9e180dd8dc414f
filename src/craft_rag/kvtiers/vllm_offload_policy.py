"""RAGCache's PGDSF as a host-tier ``CachePolicy`` for vLLM's native ``OffloadingConnector``.

On CUDA, vLLM 0.32 offloads KV to host memory itself (``OffloadingConnector`` with the CPU
spec, ``vllm/v1/kv_offload/cpu/``) and asks a pluggable, scheduler-side ``CachePolicy`` which
chunks to keep. This adapter ranks them with :class:`craft_rag.kvtiers.policies.PGDSFPolicy`
(priority = clock + frequency x cost / size) and evicts leaves of the prefix chain first.
Load it by module path (the factory imports ``name`` from ``cache_policy_module_path``)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000,
        "eviction_policy": "PGDSFCachePolicy",
        "cache_policy_module_path": "craft_rag.kvtiers.vllm_offload_policy"}}'

Tested here against vLLM 0.32's own ``CPUOffloadingManager`` (scheduler side, pure Python);
not run under a CUDA engine.

How the PGDSF terms map:

- *size*: every chunk of the manager's pool has the same bytes, so size is 1 and drops out.
- *cost*: prefix-aware prefill time of the chunk's tokens after its prefix
  (:meth:`PrefillCostModel.block_cost`), from the chunk's end-token position, which the
  scheduler records on the request (``ReqContext.get_offload_key_position``) before the store.
  The chunk's token count is the gcd of the positions seen (every position is a multiple of
  it). A chunk inserted with no position known costs one chunk at prefix 0.
- *frequency*: 1 at insertion, +1 for each request that reused it (``on_request_finished``'s
  ``reused_keys``) and for each explicit ``touch``.
- *leaf first*: vLLM finds offloaded chunks prefix first and stops at the first miss, so an
  evicted ancestor makes its descendants dead weight, and PGDSF's prefix-aware cost ranks
  deeper chunks higher, which would evict ancestors first. Parent links come from each
  finished request's keys in prefix order; a chunk with a resident child is evicted only when
  no leaf is left (its descendants pinned or protected), so eviction succeeds whenever any
  unprotected chunk is evictable, like vLLM's LRU.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus

from craft_rag.kvtiers.cost_model import PrefillCostModel, default_cost_model
from craft_rag.kvtiers.keys import BlockKey
from craft_rag.kvtiers.policies import PGDSFPolicy

Order = tuple[float, float, bytes]  # PGDSFPolicy.order: priority, last tick, key bytes

__all__ = ["PGDSFCachePolicy"]

_FALLBACK_CHUNK_TOKENS = 16  # vLLM's default CUDA block size, until a position says otherwise


def _bk(key: OffloadKey) -> BlockKey:
    """Our policy's key type for vLLM's (both are the raw bytes)."""
    return BlockKey(bytes(key))


class PGDSFCachePolicy(CachePolicy):
    """PGDSF over vLLM's offloaded chunks, leaf-first along the prefix chain.

    Invariants (:meth:`_check_invariants`): the ranked keys are exactly the resident chunks;
    evictable keys are resident; parent links join resident chunks only, and ``_children`` is
    their inverse; every evictable leaf has a current entry in the lazy heap. All state is
    owned by this object and mutated only by the manager's calls
    (vLLM's scheduler thread); not thread-safe.
    """

    def __init__(
        self,
        cache_capacity: int,
        cost_model: PrefillCostModel | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(cache_capacity)
        self._cost_model = cost_model or default_cost_model()
        self._clock = clock
        self._reset()

    def _reset(self) -> None:
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._rank = PGDSFPolicy(self._clock)
        self._evictable: set[OffloadKey] = set()
        self._parent: dict[OffloadKey, OffloadKey] = {}
        self._children: dict[OffloadKey, set[OffloadKey]] = {}
        # costs seen at a store miss, waiting for the insert; bounded (a failed allocation
        # never inserts), oldest dropped first
        self._pending_cost: dict[OffloadKey, float] = {}
        self._costs: dict[OffloadKey, float] = {}  # cost of each resident chunk
        # Lazy min-heap of (order, key) for evictable leaves, as vLLM's LRU keeps one: an entry
        # is current while its key is an evictable leaf of that same order; stale entries are
        # dropped when popped, and the heap is rebuilt when it grows past twice the pool.
        self._heap: list[tuple[Order, OffloadKey]] = []
        self._chunk_tokens = 0  # gcd of end positions seen; 0 until one is

    # --- costs -----------------------------------------------------------------------------

    def _tokens_per_chunk(self) -> int:
        return self._chunk_tokens or _FALLBACK_CHUNK_TOKENS

    def _cost_at(self, end_token: int | None) -> float:
        tokens = self._tokens_per_chunk()
        if end_token is None:
            return self._cost_model.block_cost(0, tokens)
        self._chunk_tokens = math.gcd(self._chunk_tokens, end_token)
        tokens = self._tokens_per_chunk()
        return self._cost_model.block_cost(max(end_token - tokens, 0), tokens)

    def cost(self, key: OffloadKey) -> float:
        """The cost PGDSF uses for resident ``key`` (seconds). O(1). ``KeyError`` if absent."""
        return self._costs[key]

    # --- CachePolicy -----------------------------------------------------------------------

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        """The resident chunk or ``None``. O(1)."""
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        """Add a newly allocated chunk, ranked with the cost seen at its store miss. O(1)."""
        cost = self._pending_cost.pop(key, None)
        if cost is None:
            cost = self._cost_at(None)
        self.chunks[key] = chunk
        self._costs[key] = cost
        self._rank.on_insert(_bk(key), 1, cost)
        if chunk.ref_cnt == 0:
            self._evictable.add(key)
            self._push(key)

    def remove(self, key: OffloadKey) -> None:
        """Drop a chunk whose store failed (not an eviction: the clock stays). O(children)."""
        del self.chunks[key]
        self._forget(key, evicted=False)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Count one use of each resident key (once per call). O(len(keys))."""
        for key in dict.fromkeys(keys):
            if key in self.chunks:
                self._rank.on_access(_bk(key))
                self._push(key)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Price the chunks about to be inserted from their positions. O(len(keys))."""
        for key in keys:
            self._pending_cost[key] = self._cost_at(req_context.get_offload_key_position(key))
        limit = 2 * self.cache_capacity + 64
        while len(self._pending_cost) > limit:
            del self._pending_cost[next(iter(self._pending_cost))]

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        """Count one use per reused chunk and learn parent links from each group's prefix
        order (consecutive resident keys). O(keys)."""
        del insertion_only_keys  # their insertion already counted once
        for key in reused_keys:
            if key in self.chunks:
                self._rank.on_access(_bk(key))
                self._push(key)
        for group in key_groups:
            prev: OffloadKey | None = None
            for key in group:
                if key not in self.chunks:
                    prev = None  # a gap: the chain through it is unknown
                    continue
                if prev is not None and key not in self._parent:
                    self._parent[key] = prev
                    self._children.setdefault(prev, set()).add(key)
                prev = key
        self._maybe_compact()

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """Evict exactly ``n`` evictable, unprotected chunks: leaves in PGDSF order (a parent
        joins the candidates once its last child is chosen), then, only if leaves run out,
        non-leaves in PGDSF order. Returns ``None`` and changes nothing if fewer than ``n``
        qualify. Cost: O((n + stale + protected) log H) from the lazy heap; the non-leaf
        fallback sorts the evictable chunks, O(E log E), and runs only when leaves run out."""
        if n == 0:
            return []
        if len(self._evictable) - len(self._evictable & protected) < n:
            return None
        selected: list[OffloadKey] = []
        chosen: set[OffloadKey] = set()
        put_back: list[tuple[Order, OffloadKey]] = []  # protected: popped, still current
        while self._heap and len(selected) < n:
            entry = heapq.heappop(self._heap)
            order, key = entry
            if key in chosen or not self._current(order, key, chosen):
                continue  # stale or a duplicate: dropped for good
            if key in protected:
                put_back.append(entry)
                continue
            selected.append(key)
            chosen.add(key)
            parent = self._parent.get(key)
            if parent is not None and parent in self._evictable:
                self._push(parent, chosen)  # current once all its children are chosen
        if len(selected) < n:
            rank = self._rank.order
            rest = sorted(
                (k for k in self._evictable if k not in chosen and k not in protected),
                key=lambda k: rank(_bk(k)),
            )
            selected.extend(rest[: n - len(selected)])
        assert len(selected) == n, "the count above guarantees enough candidates"
        for entry in put_back:
            heapq.heappush(self._heap, entry)
        evicted = []
        for key in selected:
            chunk = self.chunks.pop(key)
            assert chunk.ref_cnt == 0, "only idle chunks are evictable"
            self._forget(key, evicted=True)
            evicted.append((key, chunk))
        self._maybe_compact()
        return evicted

    def clear(self) -> None:
        """Forget everything, the PGDSF clock and chunk size included. O(1)."""
        self._reset()

    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)
        self._push(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.discard(key)

    # --- internals -------------------------------------------------------------------------

    def _forget(self, key: OffloadKey, *, evicted: bool) -> None:
        """Unrank and unlink a chunk already removed from ``chunks``; its children become
        roots. O(children)."""
        self._rank.on_remove(_bk(key), evicted=evicted)
        del self._costs[key]
        self._evictable.discard(key)
        parent = self._parent.pop(key, None)
        if parent is not None:
            siblings = self._children[parent]
            siblings.discard(key)
            if not siblings:
                del self._children[parent]
                if parent in self._evictable:
                    self._push(parent)
        for child in self._children.pop(key, set()):
            del self._parent[child]

    def _push(self, key: OffloadKey, chosen: set[OffloadKey] | None = None) -> None:
        """Queue ``key`` at its current order if it is an evictable leaf (counting ``chosen``
        children as gone). O(children + log H)."""
        order = self._rank.order(_bk(key))
        if key in self._evictable and self._current(order, key, chosen or set()):
            heapq.heappush(self._heap, (order, key))
            if chosen is None:  # never mid-eviction: a rebuild would drop chosen-aware entries
                self._maybe_compact()

    def _current(self, order: Order, key: OffloadKey, chosen: set[OffloadKey]) -> bool:
        """Whether a heap entry still stands: an evictable leaf (children in ``chosen``
        count as gone) whose order has not moved. O(children)."""
        if key not in self._evictable or self._rank.order(_bk(key)) != order:
            return False
        return all(child in chosen for child in self._children.get(key, ()))

    def _maybe_compact(self) -> None:
        """Keep only current entries (one per key) once the heap holds more than twice the
        resident leaves: a chunk that gains a child or is used again leaves a stale entry
        behind, and a long prompt's chunks are all leaves when inserted. O(H), amortised O(1)
        per push since H stays within twice the leaves."""
        leaves = len(self.chunks) - len(self._children)
        if len(self._heap) <= 2 * leaves + 64:
            return
        seen: set[OffloadKey] = set()
        kept = []
        for order, key in self._heap:
            if key not in seen and self._current(order, key, set()):
                seen.add(key)
                kept.append((order, key))
        heapq.heapify(kept)
        self._heap = kept

    def priority(self, key: OffloadKey) -> float:
        """PGDSF priority of resident ``key`` (lower is evicted first). O(1)."""
        return self._rank.priority(_bk(key))

    def _check_invariants(self) -> None:
        """Assert every invariant in the class docstring. O(n)."""
        keys = {_bk(k) for k in self.chunks}
        assert self._rank.keys() == keys
        assert set(self._costs) == set(self.chunks)
        assert self._evictable <= set(self.chunks)
        for child, parent in self._parent.items():
            assert child in self.chunks and parent in self.chunks
            assert child in self._children[parent]
        for parent, kids in self._children.items():
            assert kids, "empty child sets are dropped"
            assert all(self._parent[k] == parent for k in kids)
        queued = {k for order, k in self._heap if self._current(order, k, set())}
        leaves = {k for k in self._evictable if not self._children.get(k)}
        assert queued == leaves, "every evictable leaf has a current heap entry"
