"""Overlap metrics of the paper (§3.1) and reuse fractions.

``Prefix = 1/(N-1) * sum_{i>=2} max_{j<i} LCP(R_i, R_j) / k`` and
``Total = 1/(N-1) * sum_{i>=2} max_{j<i} |R_i ∩ R_j| / k``, with k taken per request as
``len(R_i)`` (requests with no chunks contribute 0).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence


def prefix_overlap(requests: Sequence[Sequence[Hashable]]) -> float:
    """Mean best longest-common-prefix fraction with any earlier request. O(total chunks) via a
    trie of earlier requests."""
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


def total_overlap(requests: Sequence[Sequence[Hashable]]) -> float:
    """Mean best shared-chunk fraction with any earlier request, position-free. O(sum of
    posting-list lengths) via an inverted index."""
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


def fraction(part: float, whole: float) -> float:
    """``part / whole``, 0.0 when ``whole`` is 0."""
    return part / whole if whole else 0.0
