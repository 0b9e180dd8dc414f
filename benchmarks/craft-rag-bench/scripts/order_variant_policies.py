"""Variant ``tree`` orders for ``order_variants.py`` (issue 16 item 2 experiments).

``tree`` makes two decisions per request: which cached path leads (the set match; among
equally long paths the most recently accessed) and how the chunks outside it are ordered (the
"rest": window count, ties by retriever rank). Each variant changes one of them. Variants
that need the served orders (co-occurrence, first-seen index) read the request the CA-Table
recorded last before each call (experiment only: the library keeps no such state). ``oracle_rest``
SEES THE FUTURE (a bound, not a policy); ``past_greedy`` is the same greedy on the whole past
(brute force: what any history-based predictor of "which chunk recurs with these" could get).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import craft_rag.ordering as O
from craft_rag.access_table import ChunkAccessTable
from craft_rag.chunk import Chunk
from craft_rag.ordering import OrderingContext

VARIANTS: dict[str, type[Variant]] = {}
FUTURE: list[list[str]] = []  # the trace's chunk keys, set by the harness (oracle only)
PAST: list[set[str]] = []  # the same as sets (past_greedy reads only requests before "now")

def _newest(table: ChunkAccessTable) -> list[str]:
    """The keys of the table's newest windowed request (reads its internals: flat
    ``_keys``/``_lengths`` deques, or the older deque of request tuples)."""
    if hasattr(table, "_lengths"):
        n = table._lengths[-1]
        keys = table._keys
        return [keys[i] for i in range(len(keys) - n, len(keys))]
    return list(table._requests[-1])


def variant(name: str) -> Callable[[type[Variant]], type[Variant]]:
    def deco(cls: type[Variant]) -> type[Variant]:
        cls.name = name
        VARIANTS[name] = cls
        return cls

    return deco


def _sorted_by(rest: list[Chunk], key: Callable[[int], Any]) -> list[Chunk]:
    return [rest[i] for i in sorted(range(len(rest)), key=key)]


class Variant:
    """``tree`` as :meth:`match` (which path leads) + :meth:`rest` (order of the others)."""

    name = "variant"
    needs_pairs = False

    def __init__(self) -> None:
        self.pairs: dict[tuple[str, str], int] = {}
        self.led: dict[str, int] = {}  # how many served orders a chunk led
        self.seen: dict[str, int] = {}  # index of the request a chunk was first served in
        self.served = 0
        self._calls = 0

    def observe(self, keys: list[str]) -> None:
        self.served += 1
        if keys:
            self.led[keys[0]] = self.led.get(keys[0], 0) + 1
        for k in keys:
            self.seen.setdefault(k, self.served)
        if self.needs_pairs:
            for i, a in enumerate(keys):
                for b in keys[i + 1:]:
                    p = (a, b) if a < b else (b, a)
                    self.pairs[p] = self.pairs.get(p, 0) + 1

    def _sync(self, table: ChunkAccessTable) -> None:
        """Observe the request served since the last call: the harness replays sequentially
        (plan, commit, plan, ...), so it is the CA-Table's newest windowed request."""
        if self._calls:
            self.observe(_newest(table))
        self._calls += 1

    def cooc(self, a: str, b: str) -> int:
        return self.pairs.get((a, b) if a < b else (b, a), 0)

    def order(self, chunks: Sequence[Chunk], context: OrderingContext) -> list[Chunk]:
        self._sync(context.access_table)
        chunks = list(chunks)
        by_key = {c.key: c for c in chunks}
        match = self.match(context, by_key)
        chosen = {n.key for n in match}
        rest = [c for c in chunks if c.key not in chosen]
        return [by_key[n.key] for n in match] + self.rest(rest, match, context)

    def match(self, context: OrderingContext, by_key: dict[str, Chunk]) -> tuple[Any, ...]:
        return context.prefix_tree.match_subset(by_key).nodes

    def rest(self, rest: list[Chunk], path: tuple[Any, ...], ctx: OrderingContext) -> list[Chunk]:
        return O._by_frequency_then_rank(rest, ctx.access_table)

    def counts(self, rest: list[Chunk], ctx: OrderingContext) -> list[int]:
        return ctx.access_table.counts([c.key for c in rest])


@variant("base")
class Base(Variant):
    """Today's ``tree`` (checked: same orders as ``craft_rag.ordering.TreeOrder``)."""


# ---- which of several equally long matched paths -------------------------------------------


def _all_best(context: OrderingContext, wanted: dict[str, Chunk]) -> list[Any]:
    """Every deepest node whose path lies in ``wanted`` (the set match's tied candidates)."""
    best: list[Any] = []
    depth = 0
    stack = [context.prefix_tree.root]
    while stack:
        children = stack.pop().children
        for key in children.keys() & wanted.keys():
            child = children[key]
            if child.depth > depth:
                best, depth = [child], child.depth
            elif child.depth == depth:
                best.append(child)
            stack.append(child)
    return best


def _path_nodes(node: Any) -> tuple[Any, ...]:
    out = []
    while node is not None and node.key is not None:
        out.append(node)
        node = node.parent
    return tuple(reversed(out))


class _Tie(Variant):
    def pick(self, best: list[Any], context: OrderingContext) -> Any:
        raise NotImplementedError

    def match(self, context: OrderingContext, by_key: dict[str, Chunk]) -> tuple[Any, ...]:
        best = _all_best(context, by_key)
        return _path_nodes(self.pick(best, context)) if best else ()


@variant("tie_count")
class TieCount(_Tie):
    """Tied paths: the deepest chunk with the highest window count, then most recent."""

    def pick(self, best: list[Any], context: OrderingContext) -> Any:
        return max(best, key=lambda n: (context.access_table.count(n.key), n.last_access))


@variant("tie_fanout")
class TieFanout(_Tie):
    """Tied paths: the deepest node with the most children, then most recent."""

    def pick(self, best: list[Any], context: OrderingContext) -> Any:
        return max(best, key=lambda n: (len(n.children), n.last_access))


@variant("tie_hits")
class TieHits(_Tie):
    """Tied paths: the deepest node with the most hits, then most recent."""

    def pick(self, best: list[Any], context: OrderingContext) -> Any:
        return max(best, key=lambda n: (n.hit_count, n.last_access))


@variant("tie_oldest")
class TieOldest(_Tie):
    """Tied paths: the least recently accessed."""

    def pick(self, best: list[Any], context: OrderingContext) -> Any:
        return min(best, key=lambda n: (n.last_access, n.path()))


# ---- the order of the chunks outside the matched path ---------------------------------------


@variant("rank_rest")
class RankRest(Variant):
    """Rest in retriever order (no frequency)."""

    def rest(self, rest: list[Chunk], path: tuple[Any, ...], ctx: OrderingContext) -> list[Chunk]:
        return rest


@variant("seen_rank")
class SeenRank(Variant):
    """Rest by (seen in the window, rank)."""

    def rest(self, rest: list[Chunk], path: tuple[Any, ...], ctx: OrderingContext) -> list[Chunk]:
        counts = self.counts(rest, ctx)
        return _sorted_by(rest, lambda i: (counts[i] == 0, i))


@variant("len_ties")
class LenTies(Variant):
    """Rest by (count, size desc, rank): longest first among equally frequent chunks."""

    def rest(self, rest: list[Chunk], path: tuple[Any, ...], ctx: OrderingContext) -> list[Chunk]:
        counts = self.counts(rest, ctx)

        def size(c: Chunk) -> int:
            return c.num_tokens if c.num_tokens is not None else len(c.text) // 4

        return _sorted_by(rest, lambda i: (-counts[i], -size(rest[i]), i))


@variant("seen_order")
class SeenOrder(Variant):
    """Rest by first-served index (a stable global order; unseen chunks last, by rank)."""

    def rest(self, rest: list[Chunk], path: tuple[Any, ...], ctx: OrderingContext) -> list[Chunk]:
        return _sorted_by(rest, lambda i: (self.seen.get(rest[i].key, 1 << 60), i))


@variant("count_seen")
class CountSeen(Variant):
    """Rest by (count, first served earliest, rank)."""

    def rest(self, rest: list[Chunk], path: tuple[Any, ...], ctx: OrderingContext) -> list[Chunk]:
        counts = self.counts(rest, ctx)
        return _sorted_by(rest, lambda i: (-counts[i], self.seen.get(rest[i].key, 1 << 60), i))


@variant("led_first")
class LedFirst(Variant):
    """Rest by (times the chunk led a served order, count, rank)."""

    def rest(self, rest: list[Chunk], path: tuple[Any, ...], ctx: OrderingContext) -> list[Chunk]:
        counts = self.counts(rest, ctx)
        return _sorted_by(rest, lambda i: (-self.led.get(rest[i].key, 0), -counts[i], i))


@variant("lead_count")
class LeadCount(Variant):
    """The first rest chunk by (count, rank), the others in retriever order."""

    def rest(self, rest: list[Chunk], path: tuple[Any, ...], ctx: OrderingContext) -> list[Chunk]:
        if len(rest) < 2:
            return rest
        counts = self.counts(rest, ctx)
        top = max(range(len(rest)), key=lambda i: (counts[i], -i))
        return [rest[top]] + [c for i, c in enumerate(rest) if i != top]


_BUCKETS: dict[str, Callable[[int], int]] = {
    "none": lambda n: 0,
    "seen": lambda n: min(n, 1),
    "log2": lambda n: n.bit_length(),
}


class _PathBucket(Variant):
    """No match: rest by (count, rank). A match of >= ``min_path`` chunks: rest by
    (bucket(count), rank)."""

    bucket = "none"
    min_path = 1

    def rest(self, rest: list[Chunk], path: tuple[Any, ...], ctx: OrderingContext) -> list[Chunk]:
        counts = self.counts(rest, ctx)
        if len(path) >= self.min_path:
            b = _BUCKETS[self.bucket]
            return _sorted_by(rest, lambda i: (-b(counts[i]), i))
        return _sorted_by(rest, lambda i: (-counts[i], i))


for _bk in _BUCKETS:
    for _mp in (1, 2):
        variant(f"path{_mp}_{_bk}")(
            type(f"Path{_mp}{_bk}", (_PathBucket,), {"bucket": _bk, "min_path": _mp})
        )


class _Greedy(Variant):
    """Greedy rest: next = the chunk with the highest ``score`` given the chunks placed."""

    needs_pairs = True

    def rest(self, rest: list[Chunk], path: tuple[Any, ...], ctx: OrderingContext) -> list[Chunk]:
        counts = dict(zip([c.key for c in rest], self.counts(rest, ctx), strict=True))
        placed = [n.key for n in path]
        out: list[Chunk] = []
        left = list(rest)
        while left:
            j = max(range(len(left)),
                    key=lambda j: (self.score(left[j].key, placed), counts[left[j].key], -j))
            c = left.pop(j)
            out.append(c)
            placed.append(c.key)
        return out

    def score(self, key: str, placed: list[str]) -> int:
        raise NotImplementedError


@variant("cooc_last")
class CoocLast(_Greedy):
    """Greedy by co-occurrence with the last placed chunk (pair counts of served orders)."""

    def score(self, key: str, placed: list[str]) -> int:
        return self.cooc(placed[-1], key) if placed else 0


@variant("cooc_sum")
class CoocSum(_Greedy):
    """Greedy by co-occurrence summed over every placed chunk."""

    def score(self, key: str, placed: list[str]) -> int:
        return sum(self.cooc(p, key) for p in placed)


class _Pool(Variant):
    """Greedy: next = the chunk most of ``pool()``'s requests hold together with the chunks
    placed so far; ties (and an empty pool) by count, then rank."""

    def pool(self) -> list[set[str]]:
        raise NotImplementedError

    def rest(self, rest: list[Chunk], path: tuple[Any, ...], ctx: OrderingContext) -> list[Chunk]:
        placed = {n.key for n in path}
        pool = [s for s in self.pool() if placed <= s]
        counts = dict(zip([c.key for c in rest], self.counts(rest, ctx), strict=True))
        out: list[Chunk] = []
        left = list(rest)
        while left:
            j = max(range(len(left)), key=lambda j: (
                sum(1 for s in pool if left[j].key in s), counts[left[j].key], -j))
            c = left.pop(j)
            out.append(c)
            pool = [s for s in pool if c.key in s]
        return out


@variant("past_greedy")
class PastGreedy(_Pool):
    """``_Pool`` over every earlier request (online, brute force)."""

    def pool(self) -> list[set[str]]:
        return PAST[: self.served]


@variant("oracle_rest")
class OracleRest(_Pool):
    """SEES THE FUTURE: ``_Pool`` over every later request (a bound, not a policy)."""

    def pool(self) -> list[set[str]]:
        return [set(r) for r in FUTURE[self.served + 1:]]


def _below(node: Any, wanted: set[str], budget: int) -> dict[str, int]:
    """How often each wanted key occurs below ``node`` (breadth first, <= budget nodes)."""
    out: dict[str, int] = {}
    queue = list(node.children.values())
    seen = 0
    while queue and seen < budget:
        nxt: list[Any] = []
        for child in queue:
            seen += 1
            if child.key in wanted:
                out[child.key] = out.get(child.key, 0) + 1
            nxt.extend(child.children.values())
            if seen >= budget:
                break
        queue = nxt
    return out


class _Subtree(Variant):
    """With a match: rest by (occurrences below the matched node, count, rank): what earlier
    requests served after this path (``budget`` nodes visited at most; ``anchor`` 0: below
    the path's first node instead, every order led by the same chunk)."""

    budget = 64
    anchor = -1

    def rest(self, rest: list[Chunk], path: tuple[Any, ...], ctx: OrderingContext) -> list[Chunk]:
        counts = self.counts(rest, ctx)
        if not path or len(rest) < 2:
            return _sorted_by(rest, lambda i: (-counts[i], i))
        below = _below(path[self.anchor], {c.key for c in rest}, self.budget)
        return _sorted_by(rest, lambda i: (-below.get(rest[i].key, 0), -counts[i], i))


for _b in (16, 64):
    variant(f"subtree_{_b}")(type(f"Subtree{_b}", (_Subtree,), {"budget": _b}))
for _b in (16, 32, 64, 256, 1 << 20):
    variant(f"subtree0_{_b}")(type(f"Subtree0{_b}", (_Subtree,), {"budget": _b, "anchor": 0}))


__all__ = ["FUTURE", "PAST", "VARIANTS", "Variant"]


class _Linear(Variant):
    """O(k) per served order: ``links[a][b]`` counts served orders where ``b`` came with ``a``
    in the relation :meth:`pairs_of` names (not O(k^2) pairs); rest greedily by the links from
    the chunk placed last (or the first placed), then count, then rank."""

    anchor_last = True

    def __init__(self) -> None:
        super().__init__()
        self.links: dict[str, dict[str, int]] = {}

    def observe(self, keys: list[str]) -> None:
        super().observe(keys)
        for a, b in self.pairs_of(keys):
            row = self.links.setdefault(a, {})
            row[b] = row.get(b, 0) + 1

    def pairs_of(self, keys: list[str]) -> list[tuple[str, str]]:
        raise NotImplementedError

    def rest(self, rest: list[Chunk], path: tuple[Any, ...], ctx: OrderingContext) -> list[Chunk]:
        counts = dict(zip([c.key for c in rest], self.counts(rest, ctx), strict=True))
        placed = [n.key for n in path]
        out: list[Chunk] = []
        left = list(rest)
        while left:
            anchor = (placed[-1] if self.anchor_last else placed[0]) if placed else None
            row = self.links.get(anchor, {}) if anchor is not None else {}
            j = max(range(len(left)),
                    key=lambda j: (row.get(left[j].key, 0), counts[left[j].key], -j))
            c = left.pop(j)
            out.append(c)
            placed.append(c.key)
        return out


@variant("next_link")
class NextLink(_Linear):
    """Links: b served right after a (successor counts over every served order)."""

    def pairs_of(self, keys: list[str]) -> list[tuple[str, str]]:
        return list(itertools.pairwise(keys))


@variant("lead_link")
class LeadLink(_Linear):
    """Links: b served in an order led by a; anchor = the first placed chunk."""

    anchor_last = False

    def pairs_of(self, keys: list[str]) -> list[tuple[str, str]]:
        return [(keys[0], b) for b in keys[1:]]


@variant("count_below0")
class CountBelow0(Variant):
    """With a match: rest by (count, occurrences below the path's first node (64 nodes),
    rank): the tree's record only breaks frequency ties."""

    def rest(self, rest: list[Chunk], path: tuple[Any, ...], ctx: OrderingContext) -> list[Chunk]:
        counts = self.counts(rest, ctx)
        if not path or len(rest) < 2:
            return _sorted_by(rest, lambda i: (-counts[i], i))
        below = _below(path[0], {c.key for c in rest}, 64)
        return _sorted_by(rest, lambda i: (-counts[i], -below.get(rest[i].key, 0), i))


@variant("seen_below0")
class SeenBelow0(Variant):
    """With a match: rest by (seen, occurrences below the path's first node, count, rank)."""

    def rest(self, rest: list[Chunk], path: tuple[Any, ...], ctx: OrderingContext) -> list[Chunk]:
        counts = self.counts(rest, ctx)
        if not path or len(rest) < 2:
            return _sorted_by(rest, lambda i: (-counts[i], i))
        below = _below(path[0], {c.key for c in rest}, 64)
        return _sorted_by(
            rest, lambda i: (counts[i] == 0, -below.get(rest[i].key, 0), -counts[i], i))


# ---- a static corpus prior: hubness (k-occurrence in the corpus's own k-NN graph) ----------
# Read from the JSON file named by CRAFT_HUB ({chunk key: k-occurrence}); it is a property of
# the corpus alone, known before any request (no lookahead on the request stream).

HUB: dict[str, int] = {}


def _hub() -> dict[str, int]:
    if not HUB:
        import json
        import os
        from pathlib import Path

        HUB.update(json.loads(Path(os.environ["CRAFT_HUB"]).read_text()))
    return HUB


@variant("hub_rest")
class HubRest(Variant):
    """Rest: window count, ties by hubness (most-neighboured passage first), then rank."""

    def rest(self, rest: list[Chunk], path: tuple[Any, ...], ctx: OrderingContext) -> list[Chunk]:
        counts, hub = self.counts(rest, ctx), _hub()
        return _sorted_by(rest, lambda i: (-counts[i], -hub.get(rest[i].key, 0), i))


@variant("hub_new")
class HubNew(Variant):
    """Rest: window count; the never-seen chunks (count 0) by hubness, seen ties by rank."""

    def rest(self, rest: list[Chunk], path: tuple[Any, ...], ctx: OrderingContext) -> list[Chunk]:
        counts, hub = self.counts(rest, ctx), _hub()
        return _sorted_by(
            rest, lambda i: (-counts[i], -hub.get(rest[i].key, 0) if counts[i] == 0 else 0, i)
        )


@variant("hub_lead")
class HubLead(Variant):
    """Rest as ``base``, except with no matched path the order leads with the highest-hub chunk
    among those tied at the top count."""

    def rest(self, rest: list[Chunk], path: tuple[Any, ...], ctx: OrderingContext) -> list[Chunk]:
        out = O._by_frequency_then_rank(rest, ctx.access_table)
        if path or len(out) < 2:
            return out
        counts, hub = self.counts(out, ctx), _hub()
        top = [i for i in range(len(out)) if counts[i] == counts[0]]
        lead = max(top, key=lambda i: (hub.get(out[i].key, 0), -i))
        return [out[lead], *out[:lead], *out[lead + 1:]]
