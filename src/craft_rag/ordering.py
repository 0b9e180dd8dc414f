"""Chunk ordering policies (paper §4.2 "Chunk Permutation for Prefix Alignment").

Each policy is a tiny object with one method, ``order(chunks, context) -> list[Chunk]``, looked
up by name in :data:`ORDERING_POLICIES`. Every policy returns a permutation of its input (the
contract test suite checks it) and reads state without changing it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from craft_rag.access_table import ChunkAccessTable
from craft_rag.chunk import Chunk
from craft_rag.prefix_tree import ChunkPrefixTree, PrefixNode
from craft_rag.types import ChunkKey
from craft_rag.validation import from_registry, registry_by_name


@dataclass(frozen=True, slots=True)
class OrderingContext:
    """Read-only view of the state a policy may consult."""

    access_table: ChunkAccessTable
    prefix_tree: ChunkPrefixTree


class OrderingPolicy(Protocol):
    name: str

    def order(self, chunks: Sequence[Chunk], context: OrderingContext) -> list[Chunk]:
        """A permutation of ``chunks`` (distinct keys) to render in this order."""
        ...


def _by_frequency(chunks: Sequence[Chunk], table: ChunkAccessTable) -> list[Chunk]:
    # Ties are broken by chunk key, never by retriever rank: two requests holding the same tied
    # chunks must put them in the same order, or the shared prefix breaks at the tie.
    counts = table.counts([c.key for c in chunks])
    decorated = sorted(zip(counts, chunks, strict=True), key=lambda p: (-p[0], p[1].key))
    return [c for _, c in decorated]


class RetrieverOrder:
    """Unchanged retriever order: the plain prefix-caching baseline. O(k)."""

    name = "retriever"

    def order(self, chunks: Sequence[Chunk], context: OrderingContext) -> list[Chunk]:
        return list(chunks)


class FrequencyOrder:
    """The paper's ``sort(C, -freq(c))`` over the CA-Table window; ties by key. O(k log k)."""

    name = "frequency"

    def order(self, chunks: Sequence[Chunk], context: OrderingContext) -> list[Chunk]:
        if not isinstance(chunks, Sequence):  # a one-shot iterable: read it once
            chunks = list(chunks)
        return _by_frequency(chunks, context.access_table)


def _by_frequency_then_rank(chunks: Sequence[Chunk], table: ChunkAccessTable) -> list[Chunk]:
    # Ties by retriever rank. The tree policy's set match already gives a chunk set
    # served before its cached order back, whatever order the retriever returns it in, so the
    # tie-break only shapes the NEW branch this request adds to the CP-Tree: a later request
    # reuses that branch up to its first chunk the later request lacks. A reworded or
    # follow-up question keeps its top-ranked chunks far more often than its tail, so rank
    # order puts the chunks most likely to recur first (measured on HotpotQA: +1.1 points of
    # Prefix overlap over ties by key; docs/benchmarks.md).
    n = len(chunks)
    if n < 2:
        return list(chunks)
    get = table._counts.get  # chunk keys are strings (checked when each Chunk was built)
    if n == 2:
        first, second = chunks
        return [second, first] if get(second.key, 0) > get(first.key, 0) else [first, second]
    if n == 3:  # a stable three-element sort, descending (ties keep rank order)
        a, b, c = chunks
        ca, cb, cc = get(a.key, 0), get(b.key, 0), get(c.key, 0)
        if cb > ca:
            a, b, ca, cb = b, a, cb, ca
        if cc > cb:
            if cc > ca:
                return [c, a, b]
            return [a, c, b]
        return [a, b, c]
    counts = [get(c.key, 0) for c in chunks]
    # Descending count; ``reverse`` keeps equal counts in their original (rank) order.
    rank = sorted(range(n), key=counts.__getitem__, reverse=True)
    return [chunks[i] for i in rank]


class TreeOrder:
    """Beyond the paper: first the longest CP-Tree path whose chunks are all in the request (a
    set match, so a request whose chunk set was served before gets its cached order back), then
    the remaining chunks by frequency, ties by retriever rank (see
    :func:`_by_frequency_then_rank`; the ``frequency`` policy, which has no set match, keeps
    ties by key so two requests with the same tied chunks agree).

    Given the same tree, this never aligns fewer chunks than the retriever order: the retriever
    order's cached prefix is itself a path inside the request's set, and the set match returns
    the longest such path. Cost: :meth:`ChunkPrefixTree.match_subset` + O(k log k).
    """

    name = "tree"

    def order(self, chunks: Sequence[Chunk], context: OrderingContext) -> list[Chunk]:
        return self.order_matched(chunks, context)[0]

    def order_matched(
        self,
        chunks: Sequence[Chunk],
        context: OrderingContext,
        by_key: dict[ChunkKey, Chunk] | None = None,
    ) -> tuple[list[Chunk], list[PrefixNode]]:
        """:meth:`order` and the CP-Tree nodes of its set-matched head. For distinct keys
        these are also ``prefix_tree.match(order)``'s nodes: a child of the head's last node
        under a chunk of the rest would be a longer path inside the set (the planner's
        ``plan`` reads them instead of walking the tree again). ``by_key``: the caller's
        ``{c.key: c for c in chunks}`` when it has one (it is consumed)."""
        if by_key is None:
            if type(chunks) is not list and not isinstance(chunks, Sequence):
                chunks = list(chunks)  # a one-shot iterable: read it once
            by_key = {c.key: c for c in chunks}
        path = context.prefix_tree.subset_path(by_key)
        if not path:
            return _by_frequency_then_rank(chunks, context.access_table), path
        if len(by_key) == len(chunks):  # distinct keys (as plan() passes them)
            pop = by_key.pop
            head = [pop(node.key) for node in path]  # type: ignore[arg-type]  # never root
            if not by_key:
                return head, path
            rest = list(by_key.values())  # the others, in input (rank) order
        else:
            head = [by_key[node.key] for node in path]  # type: ignore[index]  # never root
            chosen = {node.key for node in path}
            rest = [c for c in chunks if c.key not in chosen]
        return head + _by_frequency_then_rank(rest, context.access_table), path


ORDERING_POLICIES: Mapping[str, Callable[[], OrderingPolicy]] = registry_by_name(
    RetrieverOrder, FrequencyOrder, TreeOrder
)

DEFAULT_POLICY = "tree"


def get_policy(name: str) -> OrderingPolicy:
    """A new policy object by name; ``ValueError`` lists the valid names."""
    return from_registry(ORDERING_POLICIES, name, "ordering policy")
