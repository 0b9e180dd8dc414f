"""Overlap metrics of the paper (§3.1) and reuse fractions.

``Prefix = 1/(N-1) * sum_{i>=2} max_{j<i} LCP(R_i, R_j) / k`` and
``Total = 1/(N-1) * sum_{i>=2} max_{j<i} |R_i ∩ R_j| / k``, with k taken per request as
``len(R_i)`` (requests with no chunks contribute 0).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence

from craft_rag.validation import materialise


def _checked(requests: Iterable[Iterable[Hashable]]) -> list[tuple[Hashable, ...]]:
    """``requests`` read once, each request a tuple of hashable chunk ids. ``ValueError``
    naming the request for a non-iterable, a bare string (one id, not a list of ids) or an
    unhashable id. O(total chunks)."""
    out: list[tuple[Hashable, ...]] = []
    for i, request in enumerate(materialise(requests, "requests")):
        items = materialise(request, f"requests[{i}]")
        for j, key in enumerate(items):
            try:
                hash(key)
            except TypeError:
                msg = f"requests[{i}][{j}]: chunk ids must be hashable, got {type(key).__name__}"
                raise ValueError(msg) from None
        out.append(items)
    return out


def prefix_overlap(requests: Iterable[Iterable[Hashable]]) -> float:
    """Mean best longest-common-prefix fraction with any earlier request. O(total chunks) via a
    trie of earlier requests. Any iterables (read once); ``ValueError`` for malformed input."""
    requests = _checked(requests)
    if len(requests) < 2:
        return 0.0
    trie: dict[Hashable, dict] = {}  # type: ignore[type-arg]
    total = 0.0
    for i, request in enumerate(requests):
        node = trie
        depth = 0
        for key in request:
            child = node.get(key)
            if child is None:
                break
            node = child
            depth += 1
        if i > 0 and request:
            total += depth / len(request)
        node = trie
        for key in request:
            node = node.setdefault(key, {})
    return total / (len(requests) - 1)


def total_overlap(requests: Iterable[Iterable[Hashable]]) -> float:
    """Mean best shared-chunk fraction with any earlier request, position-free. O(sum of
    posting-list lengths) via an inverted index. Input as for :func:`prefix_overlap`."""
    requests = _checked(requests)
    if len(requests) < 2:
        return 0.0
    postings: dict[Hashable, list[int]] = {}
    total = 0.0
    for i, request in enumerate(requests):
        distinct = list(dict.fromkeys(request))
        if i > 0 and distinct:
            shared: Counter[int] = Counter()
            for key in distinct:
                shared.update(postings.get(key, ()))
            best = max(shared.values(), default=0)
            total += best / len(request)
        for key in distinct:
            postings.setdefault(key, []).append(i)
    return total / (len(requests) - 1)


def lcp(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the longest common prefix of two sequences. O(min(len))."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values. O(n log n): sorts a copy."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def fraction(part: float, whole: float) -> float:
    """``part / whole``, 0.0 when ``whole`` is 0."""
    return part / whole if whole else 0.0


def chunks_inside_cache(chunk_spans: Sequence[tuple[int, int]], cached_tokens: int) -> int:
    """How many leading chunks were reused: chunk ``[start, end)`` counts only when ALL its
    tokens lie inside the cached prefix (``end <= cached_tokens``); counting stops at the first
    chunk that does not. Nothing cached (a cold request) gives 0. The one definition of
    "reused chunk" shared by the engine's ``ReuseReport`` and trace replay. O(k)."""
    n = 0
    for _, end in chunk_spans:
        if end > cached_tokens:
            break
        n += 1
    return n


def chunks_with_cached_blocks(
    chunk_spans: Sequence[tuple[int, int]], cached_tokens: int, block_size: int
) -> int:
    """Leading chunks whose KV blocks the cache still holds: the evidence
    ``CraftPlanner.commit(reused_chunks=...)`` needs to prune stale CP-Tree nodes.

    A chunk counts when all its tokens are cached, or when at least one full block ends inside
    it and every such block was a hit: its trailing partial block is shared with whatever
    follows (the next chunk or the question), so it only hits when that matches too, and
    requiring it would prune the last chunk of every cached path. A chunk with no full block
    of its own (shorter than a block, inside one) needs all its tokens cached, so a cold
    request (``cached_tokens == 0``) always gives 0. Never smaller than
    :func:`chunks_inside_cache`. O(k)."""
    if block_size < 1:
        msg = f"block_size must be >= 1, got {block_size}"
        raise ValueError(msg)
    n = 0
    for start, end in chunk_spans:
        full_end = end // block_size * block_size
        if end > cached_tokens and (full_end <= start or full_end > cached_tokens):
            break
        n += 1
    return n
