"""Plans waiting for the engine: the postprocessor parks them here, the engine path claims them.

With ``commit_mode="engine"`` the postprocessor plans but does not commit, because only the
engine knows what it actually reused. The LlamaIndex pipeline between the two passes plain node
lists, so a plan is found again by what identifies it in those lists: the conversation id and
the planned chunk keys in order. Two requests with the same keys in the same conversation get
equivalent plans, so claiming either is correct (oldest first).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Sequence

from craft_rag import ChunkKey, Plan

DEFAULT_MAX_PENDING = 1024

HandoffKey = tuple[str | None, tuple[ChunkKey, ...]]


class PlanHandoff:
    """Bounded, thread-safe map from ``(conversation id, planned keys)`` to unclaimed plans.

    Invariant: at most ``max_pending`` plans are held; when full, the oldest is dropped (a plan
    that is never served must not be committed, so dropping it is the correct outcome). Owner:
    the :class:`~llama_index.postprocessor.craft.CraftReorderPostprocessor` that parks plans;
    claimers only remove. ``put``/``claim`` cost O(1) plus the key tuple's hash, O(k).
    """

    def __init__(self, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if max_pending < 1:
            msg = f"max_pending must be >= 1, got {max_pending}"
            raise ValueError(msg)
        self._max = max_pending
        self._lock = threading.Lock()
        self._plans: OrderedDict[HandoffKey, deque[Plan]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def put(self, plan: Plan) -> None:
        key: HandoffKey = (plan.conversation_id, plan.keys)
        with self._lock:
            self._plans.setdefault(key, deque()).append(plan)
            self._size += 1
            while self._size > self._max:
                oldest_key, queue = next(iter(self._plans.items()))
                queue.popleft()
                self._size -= 1
                if not queue:
                    del self._plans[oldest_key]

    def claim(self, conversation_id: str | None, keys: Sequence[ChunkKey]) -> Plan | None:
        """Remove and return the oldest plan for these keys, or ``None`` when there is none."""
        key: HandoffKey = (conversation_id, tuple(keys))
        with self._lock:
            queue = self._plans.get(key)
            if not queue:
                return None
            plan = queue.popleft()
            self._size -= 1
            if not queue:
                del self._plans[key]
            return plan

    def _check_invariants(self) -> None:
        assert self._size == sum(len(q) for q in self._plans.values())
        assert self._size <= self._max
        assert all(self._plans.values()), "no empty queues are kept"
