"""The simulated vLLM-like prefix cache: chained block hashes, block granularity, the last
prompt token never cached, LRU eviction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from craft_rag.metrics import lcp
from craft_rag.prefix_cache_sim import SimulatedPrefixCache, block_hashes


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_hashes(list(range(11)), 4)) == 2
    assert len(block_hashes(list(range(12)), 4)) == 3
    assert block_hashes([1, 2, 3], 4) == []
    assert block_hashes([], 4) == []


def test_hashes_are_chained() -> None:
    base = list(range(16))
    hashes = block_hashes(base, 4)
    changed_block_1 = base.copy()
    changed_block_1[5] = 99  # inside block 1 (tokens 4..7)
    other = block_hashes(changed_block_1, 4)
    assert other[0] == hashes[0]
    assert all(a != b for a, b in zip(other[1:], hashes[1:], strict=True))  # all later blocks miss
    changed_block_0 = base.copy()
    changed_block_0[0] = 99
    assert all(a != b for a, b in zip(block_hashes(changed_block_0, 4), hashes, strict=True))


def test_equal_blocks_after_different_prefixes_hash_differently() -> None:
    a = block_hashes([1, 1, 1, 1, 7, 7, 7, 7], 4)
    b = block_hashes([2, 2, 2, 2, 7, 7, 7, 7], 4)
    assert a[1] != b[1]
    assert len(set(block_hashes([5] * 16, 4))) == 4  # repeated content, distinct positions


def test_hashes_are_deterministic_and_take_large_token_ids() -> None:
    tokens = [0, 2**31 - 1, 2**40, 7]
    assert block_hashes(tokens, 2) == block_hashes(list(tokens), 2)


def test_last_prompt_token_is_never_cached() -> None:
    cache = SimulatedPrefixCache(block_size=4, capacity_tokens=1024)
    prompt = list(range(12))  # exactly 3 blocks: the 3rd block holds the last token
    assert cache.serve(prompt) == 0
    assert cache.serve(prompt) == 8
    longer = [*prompt, 100]  # one more token: all 3 blocks can be reused
    assert cache.serve(longer) == 12


def test_block_granularity() -> None:
    cache = SimulatedPrefixCache(block_size=4, capacity_tokens=1024)
    cache.serve([1, 2, 3, 4, 5, 6, 7, 8, 9])
    # shares 6 tokens: only the first full block is reused
    assert cache.serve([1, 2, 3, 4, 5, 6, 0, 0, 0]) == 4
    # shares 8 tokens: two blocks
    assert cache.serve([1, 2, 3, 4, 5, 6, 7, 8, 0, 0]) == 8
    # differs in the first token: nothing
    assert cache.serve([0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0


def test_short_prompts() -> None:
    cache = SimulatedPrefixCache(block_size=4, capacity_tokens=64)
    assert cache.serve([1]) == 0 and cache.serve([1]) == 0
    assert cache.serve([]) == 0
    assert len(cache) == 0
    cache.serve([1, 2, 3, 4])
    assert len(cache) == 1
    assert cache.serve([1, 2, 3, 4]) == 0  # its only block holds the last token
    assert cache.serve([1, 2, 3, 4, 5]) == 4


def test_lru_eviction_order_frees_a_request_tail_first() -> None:
    cache = SimulatedPrefixCache(block_size=2, capacity_tokens=6)  # 3 blocks
    p1 = [1, 1, 2, 2, 0]  # blocks p1a, p1b
    p2 = [3, 3, 4, 4, 0]  # blocks p2a, p2b
    cache.serve(p1)
    cache.serve(p2)  # 4 blocks > 3: p1's tail block p1b goes first
    assert len(cache) == 3 and cache.evicted_blocks == 1
    assert cache.serve(p1) == 2  # p1a survived, p1b did not
    # p1 was re-cached, touching its head last: p2's tail block was evicted next
    assert cache.evicted_blocks == 2
    assert cache.serve(p2) == 2
    assert cache.serve(p2) == 4


def test_a_hit_refreshes_recency() -> None:
    cache = SimulatedPrefixCache(block_size=2, capacity_tokens=4)  # 2 blocks
    a, b, c = [1, 1, 0], [2, 2, 0], [3, 3, 0]
    cache.serve(a)
    cache.serve(b)
    assert cache.serve(a) == 2  # a is now most recent
    cache.serve(c)  # evicts b, the least recently used
    assert cache.serve(a) == 2
    assert cache.serve(b) == 0


def test_no_prefix_caching_baseline() -> None:
    cache = SimulatedPrefixCache(block_size=2, capacity_tokens=64)
    prompt = [1, 2, 3, 4, 5]
    assert cache.serve(prompt, read_cache=False) == 0
    assert len(cache) == 0
    assert cache.serve(prompt, read_cache=False) == 0


def test_clear() -> None:
    cache = SimulatedPrefixCache(block_size=2, capacity_tokens=64)
    cache.serve([1, 2, 3])
    cache.clear()
    assert len(cache) == 0
    assert cache.serve([1, 2, 3]) == 0


@pytest.mark.parametrize(
    ("block_size", "capacity", "message"),
    [(0, 10, "block_size"), (4, 3, "capacity_tokens")],
)
def test_bad_arguments(block_size: int, capacity: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SimulatedPrefixCache(block_size, capacity)


def test_capacity_rounds_down_to_whole_blocks() -> None:
    assert SimulatedPrefixCache(block_size=4, capacity_tokens=11).capacity_blocks == 2


prompts = st.lists(st.lists(st.integers(0, 2), max_size=14), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(prompts=prompts, block_size=st.integers(1, 4))
def test_hits_equal_brute_force_with_unbounded_capacity(
    prompts: list[list[int]], block_size: int
) -> None:
    cache = SimulatedPrefixCache(block_size, capacity_tokens=10_000)
    for i, prompt in enumerate(prompts):
        best = 0
        for earlier in prompts[:i]:
            blocks = min(
                lcp(prompt, earlier) // block_size,
                len(earlier) // block_size,  # only full blocks were cached
                (len(prompt) - 1) // block_size,  # the last token is recomputed
            )
            best = max(best, blocks)
        assert cache.serve(prompt) == best * block_size


@settings(max_examples=100, deadline=None)
@given(prompts=prompts, block_size=st.integers(1, 3), capacity_blocks=st.integers(1, 5))
def test_capacity_is_never_exceeded_and_hits_never_beat_unbounded(
    prompts: list[list[int]], block_size: int, capacity_blocks: int
) -> None:
    small = SimulatedPrefixCache(block_size, capacity_blocks * block_size)
    big = SimulatedPrefixCache(block_size, 10_000)
    for prompt in prompts:
        hit = small.serve(prompt)
        assert hit <= big.serve(prompt)
        assert hit % block_size == 0
        assert len(small) <= capacity_blocks
