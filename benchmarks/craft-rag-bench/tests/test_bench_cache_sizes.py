"""The ``cache-sizes`` suite (issue 16 item 4): working set and size computation, predicted vs
actual aggregation, and the sweep itself on fake engines (``craft_rag.testing``) whose cache
evicts. The real-engine sweep needs one engine per KV size; CI keeps one engine per session
(the ``craft_engine`` fixture cannot change its size), so no test starts a second one: the
suite's handling of a lent engine is tested instead, and the real run is in docs/benchmarks.md.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from craft_rag.chunk import make_chunk
from craft_rag.engine import CraftEngine, GenerationResult, ReuseReport, SamplingRequest
from craft_rag.testing import FakeBackend, make_fake_engine
from craft_rag.trace import TraceRequest
from craft_rag_bench.bench import cache_sizes
from craft_rag_bench.bench.cache_sizes import (
    SMALL_REQUESTS,
    WorkingSet,
    cache_blocks,
    parse_cache_sizes,
    report_lines,
    reuse_accuracy,
    sweep,
    working_set,
)
from craft_rag_bench.bench.cli import NOT_IN_ALL, SUITES
from craft_rag_bench.bench.context import BenchContext


def test_working_set_counts_shared_prefix_blocks_once() -> None:
    ws = working_set([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 7]], 4, max_tokens=0)
    assert ws.request_blocks == 2 + 3  # the partial last block counts for the request
    assert ws.distinct_blocks == 3  # [1..4] shared, then [5..8] and [9,9,9,9]
    assert ws.max_request_blocks == 3
    assert ws.mean_request_blocks == 2.5
    # Same block content after a different prefix is a different block (chained, as vLLM).
    other_parent = working_set([[1, 1, 1, 1, 5, 5, 5, 5], [2, 2, 2, 2, 5, 5, 5, 5]], 4, 0)
    assert other_parent.distinct_blocks == 4
    # Generated tokens need room too.
    assert working_set([[1, 2, 3, 4]], 4, max_tokens=1).request_blocks == 2
    with pytest.raises(ValueError, match="at least one prompt"):
        working_set([], 4, 0)


def ws_of(request_blocks: int, mean: float, largest: int) -> WorkingSet:
    return WorkingSet(requests=30, block_size=32, request_blocks=request_blocks,
                      distinct_blocks=request_blocks // 2, mean_request_blocks=mean,
                      max_request_blocks=largest)


def test_cache_blocks_from_whole_down_to_ten_requests() -> None:
    ws = ws_of(730, 24.33, 36)
    sizes = cache_blocks(("small", "whole", "medium"), ws)
    assert [label for label, _ in sizes] == ["whole", "medium", "small"]  # largest first
    blocks = dict(sizes)
    assert blocks["whole"] == 730 + 36  # every request + one more (the warm-up)
    assert blocks["small"] == 244 == -(-SMALL_REQUESTS * 24.33 // 1)
    assert blocks["medium"] == round((766 * 244) ** 0.5)
    assert cache_blocks(("64", "whole", "64"), ws) == [("whole", 766), ("64", 64)]
    with pytest.raises(ValueError, match="at least 37 blocks"):
        cache_blocks(("36",), ws)
    # A trace of fewer than ten requests: small cannot exceed whole.
    tiny = ws_of(60, 20.0, 30)
    assert dict(cache_blocks(("whole", "small"), tiny)) == {"whole": 90}


def test_parse_cache_sizes() -> None:
    assert parse_cache_sizes(" Whole, small,64 ") == ("whole", "small", "64")
    for bad in ("", "tiny", "0", "whole,-3", "1.5"):
        with pytest.raises(ValueError, match="--cache-sizes"):
            parse_cache_sizes(bad)


def result(prompt: int, cached: int, predicted: int | None, chunks: tuple[int, int] = (0, 0)
           ) -> GenerationResult:
    report = ReuseReport(
        request_id="r", prompt_tokens=prompt, cached_tokens=cached, predicted_tokens=predicted,
        predicted_chunks=chunks[0], reused_chunks=chunks[1], prefix_tokens=10, ttft_ms=1.0,
        latency_ms=2.0, output_tokens=1, chunk_order=(), removed_duplicates=(),
        repeated_in_request=(), dropped_turns=0, conversation_id=None, turn=1,
        read_prefix_cache=True,
    )
    return GenerationResult(text="", token_ids=(), finish_reason="length", report=report)


def test_reuse_accuracy_sums_over_and_under_prediction() -> None:
    acc = reuse_accuracy(
        [result(100, 64, 70, (2, 2)), result(100, 0, 96, (3, 0)), result(100, 96, 32, (1, 3)),
         result(100, 32, None)],
        block_size=32,
    )
    assert acc["requests"] == 4 and acc["unpredicted"] == 1
    assert acc["prompt_tokens"] == 400 and acc["cached_tokens"] == 192
    assert acc["predicted_tokens"] == 70 + 96 + 32
    assert acc["over_predicted_tokens"] == 6 + 96
    assert acc["under_predicted_tokens"] == 64
    assert acc["within_block"] == pytest.approx(1 / 3)  # only |70 - 64| < 32
    assert acc["stale_requests"] == 1  # 96 predicted, 0 cached
    assert acc["cached_fraction"] == pytest.approx(0.48)
    assert acc["predicted_fraction"] == pytest.approx(198 / 400)
    assert (acc["predicted_chunks"], acc["reused_chunks"], acc["over_predicted_chunks"]) == (
        6, 5, 3)
    assert reuse_accuracy([], 32)["cached_fraction"] == 0.0


@dataclass
class EvictingBackend(FakeBackend):
    """The fake backend with a KV capacity: least recently used blocks are evicted, and (like
    a cache whose events are not heard) nothing tells the planner."""

    capacity: int = 1 << 30
    lru: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def add_request(self, request_id: str, token_ids: Sequence[int], sampling: SamplingRequest,
                    cache_salt: str | None = None) -> None:
        super().add_request(request_id, token_ids, sampling, cache_salt)
        for h in self.block_hasher.raw_hashes(token_ids, cache_salt):
            self.lru[h] = None
            self.lru.move_to_end(h)
        while len(self.lru) > self.capacity:
            old, _ = self.lru.popitem(last=False)
            self.cached_blocks.discard(old)

    def reset_prefix_cache(self) -> bool:
        self.lru.clear()
        return super().reset_prefix_cache()


def shuffled_trace(requests: int = 40, seed: int = 0) -> list[TraceRequest]:
    """Requests drawing 4 of 10 shared passages, in random (retriever) orders."""
    rng = random.Random(seed)
    pool = [make_chunk(" ".join(f"w{rng.randrange(200)}" for _ in range(24)), id=f"p{i}")
            for i in range(10)]
    return [TraceRequest(id=f"q{i}", query=f"Question {i}?", chunks=tuple(rng.sample(pool, 4)))
            for i in range(requests)]


def test_sweep_on_evicting_fake_engines() -> None:
    made: list[EvictingBackend] = []

    def make(blocks: int) -> CraftEngine:
        backend = EvictingBackend(capacity=blocks, max_model_len=1024)
        made.append(backend)
        return make_fake_engine(backend)[0]

    ctx = BenchContext(progress=False)
    systems = ("no_cache", "prefix_cache", "craft_tree", "long_context_reorder")
    rows = sweep(ctx, shuffled_trace(), [("whole", 100_000), ("small", 30)], make,
                 systems=systems, max_tokens=2)
    assert [r["size"] for r in rows] == ["whole", "small"]
    assert all(b.shut_down for b in made) and [b.capacity for b in made] == [100_000, 30]
    whole, small = ({n: s["accuracy"] for n, s in r["systems"].items()} for r in rows)
    assert whole["no_cache"]["cached_tokens"] == 0 == small["no_cache"]["cached_tokens"]
    assert whole["craft_tree"]["cached_fraction"] > whole["prefix_cache"]["cached_fraction"]
    for name in systems:
        assert small[name]["cached_tokens"] <= whole[name]["cached_tokens"]
        assert small[name]["prompt_tokens"] == whole[name]["prompt_tokens"]
    # Without evictions the planner never predicts a whole block the cache did not have...
    assert whole["craft_tree"]["stale_requests"] == 0
    assert whole["craft_tree"]["within_block"] == 1.0
    # ...with evictions it cannot hear, it does (the figure the real run reports per system).
    assert small["craft_tree"]["stale_requests"] > 0
    assert small["craft_tree"]["over_predicted_tokens"] > whole["craft_tree"][
        "over_predicted_tokens"]
    assert rows[0]["systems"]["craft_tree"]["events"]["kv_events"] == 0  # fakes publish none
    assert rows[0]["tree_vs"]["prefix_cache"]["ahead_cached"] is True
    assert rows[0]["systems"]["no_cache"]["normalised_mean"] == pytest.approx(1.0)
    text = "\n".join(report_lines({"workloads": {"w": {
        "requests": 40, "working_set": {"distinct_blocks": 1, "request_blocks": 2,
                                        "block_size": 16}, "sizes": rows}}}))
    assert "| small | 30 | craft_tree |" in text and "tree vs prefix_cache ahead" in text


def test_suite_leaves_a_lent_engine_alone() -> None:
    engine, backend = make_fake_engine()
    try:
        ctx = BenchContext(progress=False, engine=engine)
        out = cache_sizes.run(ctx)
        assert "skipped" in out and out["workloads"] == {}
        assert ctx.engine is engine and not backend.shut_down
        assert report_lines(out)[0].startswith("Skipped:")
    finally:
        engine.close()


def test_cache_sizes_is_a_suite_that_all_skips() -> None:
    assert "cache-sizes" in SUITES and "cache-sizes" in NOT_IN_ALL
