"""A simulated prefix cache that behaves like vLLM's automatic prefix caching.

- KV is cached per full block of ``block_size`` tokens; a block's hash chains its parent's hash
  and its tokens, so a block hits only if the whole prefix before it is identical.
- A lookup considers at most ``len(prompt) - 1`` tokens (vLLM always recomputes the last prompt
  token) and returns the longest run of leading blocks that are cached.
- After a request all its full blocks are cached; capacity is ``capacity_tokens // block_size``
  blocks, evicted least recently used first. A request's blocks are freed tail first (as vLLM
  appends freed blocks in reverse order), so its later blocks are evicted before its earlier ones.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

from craft_rag.validation import check_int

_ROOT = b"craft-rag-sim-root"


def block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of every full block of ``tokens``. O(len(tokens))."""
    hashes: list[bytes] = []
    parent = _ROOT
    for start in range(0, len(tokens) - block_size + 1, block_size):
        try:
            block = array("q", tokens[start : start + block_size]).tobytes()
        except (TypeError, OverflowError) as exc:
            msg = f"tokens: must be token ids (ints within int64), got {exc}"
            raise ValueError(msg) from None
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent)
    return hashes


class SimulatedPrefixCache:
    """LRU block cache. Invariant: ``len(self._blocks) <= capacity_blocks``."""

    def __init__(
        self,
        block_size: int = 32,
        capacity_tokens: int = 1 << 20,
        *,
        on_evict: Callable[[bytes], None] | None = None,
    ) -> None:
        """``on_evict`` hears each evicted block's hash (a KV "block removed" event)."""
        check_int(block_size, "block_size", minimum=1)
        check_int(capacity_tokens, "capacity_tokens", minimum=1)
        if capacity_tokens < block_size:
            msg = f"capacity_tokens ({capacity_tokens}) must hold at least one block ({block_size})"
            raise ValueError(msg)
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.evicted_blocks = 0
        self._on_evict = on_evict

    def serve(self, tokens: Sequence[int], *, read_cache: bool = True) -> int:
        """Run one prompt: returns the number of cached tokens it reused, then caches its full
        blocks. ``read_cache=False`` models a no-prefix-caching baseline (nothing reused, nothing
        stored). O(len(tokens))."""
        if not read_cache:
            return 0
        hashes = block_hashes(tokens, self.block_size)
        lookup_blocks = max(0, (len(tokens) - 1) // self.block_size)
        hit = 0
        for h in hashes[:lookup_blocks]:
            if h not in self._blocks:
                break
            hit += 1
        for h in reversed(hashes):
            # MRU end = hottest; insert tail-first so the prompt's head ends up most recent.
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            evicted, _ = self._blocks.popitem(last=False)
            self.evicted_blocks += 1
            if self._on_evict is not None:
                self._on_evict(evicted)
        return hit * self.block_size

    def clear(self) -> None:
        self._blocks.clear()

    def __len__(self) -> int:
        return len(self._blocks)
