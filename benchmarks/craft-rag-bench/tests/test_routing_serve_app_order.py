"""``serve_on_replicas`` with a serving-layer policy: the app planner orders the prompts the
router sees (fake engines; the real run is tests/test_routing_replicas.py)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, cast

import pytest

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.planner import CraftPlanner, Plan
from craft_rag.trace import TraceRequest
from craft_rag_bench.bench.routing import serve_on_replicas


class FakeEngine:
    """What serve_on_replicas uses of a CraftEngine: planners, a reset, generate(plan=)."""

    block_size = 16

    def __init__(self) -> None:
        self.planner: CraftPlanner | None = None
        self.sent: list[tuple[str, ...]] = []

    def planner_for(self, salt: str | None) -> CraftPlanner:
        assert self.planner is not None
        return self.planner

    def set_planner(self, planner: CraftPlanner) -> None:
        self.planner = planner

    def reset_prefix_cache(self) -> bool:
        return True

    def generate(self, chunks: Sequence[Chunk], query: str, *, plan: Plan, max_tokens: int
                 ) -> Any:
        assert self.planner is not None
        self.sent.append(tuple(c.key for c in chunks))
        self.planner.commit(plan, prefix_tokens=16)
        report = SimpleNamespace(ttft_ms=1.0, cached_tokens=0, prompt_tokens=100,
                                 prefix_tokens=16, reused_chunks=len(chunks))
        return SimpleNamespace(report=report)


def trace() -> list[TraceRequest]:
    pool = [make_chunk(f"passage {i}", id=f"p{i}", num_tokens=32) for i in range(3)]
    orders = [(0, 1, 2), (2, 0, 1), (1, 2, 0), (2, 1, 0)]
    return [TraceRequest(id=f"q{i}", query=f"question {i}?",
                         chunks=tuple(pool[j] for j in order))
            for i, order in enumerate(orders)]


@pytest.mark.parametrize(("policy", "app_ordered"),
                         [("prefix_blocks", False), ("prefix_craft_order", True)])
def test_the_app_planner_orders_what_the_serving_layer_routes(policy: str,
                                                               app_ordered: bool) -> None:
    engines = {"r0": FakeEngine(), "r1": FakeEngine()}
    requests = trace()
    out = serve_on_replicas(cast(Any, engines), requests, policy, lambda r: 128)
    assert sum(out["requests_per_replica"].values()) == len(requests)
    sent = [order for engine in engines.values() for order in engine.sent]
    if app_ordered:  # one chunk set, one order: the app planner's, whatever the retriever said
        assert len(set(sent)) == 1
    else:
        assert sorted(sent) == sorted(tuple(c.key for c in r.chunks) for r in requests)
