"""The CP-Tree's value types: a node, a match, where KV lives, metadata to attach on insert.

The tree and its operations are :mod:`craft_rag.tree.tree`; :mod:`craft_rag.tree` re-exports
the public names here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, cast

from craft_rag.types import BlockHash, ChunkKey, as_block_hash
from craft_rag.validation import check_int, check_text, materialise

__all__ = [
    "NO_CHILDREN",
    "KVLocation",
    "NodeMetadata",
    "OneChild",
    "PrefixMatch",
    "PrefixNode",
    "add_child",
    "block_hash_tuple",
    "drop_child",
    "new_leaf",
]


@dataclass(frozen=True, slots=True)
class KVLocation:
    """Where a prefix's KV lives: which engine (replica) and which memory tier."""

    engine_id: str = "local"
    tier: str = "device"

    def __post_init__(self) -> None:
        engine_id, tier = self.engine_id, self.tier
        # Fast path (one per commit): non-empty ASCII str is valid; anything else gets the
        # full check and its error.
        if type(engine_id) is str and type(tier) is str and engine_id.isascii() and (
            tier.isascii() and engine_id and tier
        ):
            return
        check_text(engine_id, "KVLocation.engine_id", nonempty=True)
        check_text(tier, "KVLocation.tier", nonempty=True)


NO_CHILDREN: Mapping[ChunkKey, PrefixNode] = MappingProxyType({})
"""The ``children`` of every node that has none: one shared read-only empty mapping instead of
an empty dict per leaf (most nodes are leaves: less memory, less for the GC). Writing into
it raises ``TypeError``; add children with :func:`add_child`."""


class OneChild(Mapping[ChunkKey, "PrefixNode"]):
    """The ``children`` of a node with exactly one child: the read-only mapping
    ``{child.key: child}`` in one 40-byte object instead of a 184-byte dict. Served chunk
    orders are chains, so most inner CP-Tree nodes have one child (60,000 of 65,536
    nodes at k=20). Behaves like that dict for reading (``get``, ``[]``, ``in``, ``keys() &
    other``, iteration in insertion order); :func:`add_child` / :func:`drop_child` change it."""

    __slots__ = ("child",)

    def __init__(self, child: PrefixNode) -> None:
        self.child = child

    def __getitem__(self, key: ChunkKey) -> PrefixNode:
        child = self.child
        if key == child.key:
            return child
        raise KeyError(key)

    def get(self, key: ChunkKey, default: Any = None) -> Any:
        child = self.child
        if key == child.key:
            return child
        hash(key)  # an unhashable key is a TypeError, as for a dict
        return default

    def __contains__(self, key: object) -> bool:
        if key == self.child.key:
            return True
        hash(key)  # an unhashable key is a TypeError, as for a dict
        return False

    def __iter__(self) -> Iterator[ChunkKey]:
        return iter((cast("ChunkKey", self.child.key),))

    def __len__(self) -> int:
        return 1

    def keys(self) -> frozenset[ChunkKey]:  # type: ignore[override]
        """A set (``keys() & wanted`` is one C-level intersection, as for a dict's keys)."""
        return frozenset((cast("ChunkKey", self.child.key),))

    def values(self) -> tuple[PrefixNode]:  # type: ignore[override]
        return (self.child,)

    def items(self) -> tuple[tuple[ChunkKey, PrefixNode]]:  # type: ignore[override]
        return ((cast("ChunkKey", self.child.key), self.child),)

    def __repr__(self) -> str:
        return f"OneChild({self.child.key!r})"


def add_child(parent: PrefixNode, key: ChunkKey, child: PrefixNode) -> None:
    """Link ``child`` (whose ``key`` is ``key``) under ``parent``: a first child is a
    :class:`OneChild`, a second one turns it into a dict (insertion order kept). O(1)."""
    children = parent.children
    if children is NO_CHILDREN:
        parent.children = OneChild(child)
    elif type(children) is OneChild:
        only = children.child
        parent.children = {only.key: only, key: child}  # type: ignore[dict-item]  # never root
    else:
        children[key] = child  # type: ignore[index]  # a dict (no typing.cast call: hot path)


def drop_child(parent: PrefixNode, key: ChunkKey) -> None:
    """Unlink ``parent``'s child ``key`` (which must exist); the last child leaves
    :data:`NO_CHILDREN`, the second-to-last a :class:`OneChild`. O(1)."""
    children = parent.children
    if type(children) is OneChild:
        parent.children = NO_CHILDREN
        return
    del children[key]  # type: ignore[attr-defined]  # a dict (no typing.cast call: hot path)
    if len(children) == 1:
        for only in children.values():
            parent.children = OneChild(only)


@dataclass(slots=True, eq=False, init=False)
class PrefixNode:
    """One chunk at one position of a chunk-prefix. Owner: :class:`ChunkPrefixTree` only.

    ``token_start``/``token_end`` is the chunk's ``[start, end)`` span within the prompt (None when
    token counts were never supplied); ``block_hashes`` are the engine's hashes of the full KV
    blocks whose last token falls inside that span. ``children`` is a read-only mapping: the
    shared :data:`NO_CHILDREN` for a leaf, a :class:`OneChild` for one child, else a dict (link
    and unlink with :func:`add_child` / :func:`drop_child`).
    """

    key: ChunkKey | None
    parent: PrefixNode | None
    depth: int
    children: Mapping[ChunkKey, PrefixNode]
    token_start: int | None
    token_end: int | None
    location: KVLocation | None
    block_hashes: tuple[BlockHash, ...]
    hit_count: int
    last_access: float
    alive: bool
    heap_stamp: int  # stamp of this node's current entry in the leaf queue (tree.eviction)

    def __init__(
        self,
        key: ChunkKey | None,
        parent: PrefixNode | None,
        depth: int,
        children: Mapping[ChunkKey, PrefixNode] = NO_CHILDREN,
        token_start: int | None = None,
        token_end: int | None = None,
        location: KVLocation | None = None,
        block_hashes: tuple[BlockHash, ...] = (),
        hit_count: int = 0,
        last_access: float = 0.0,
        alive: bool = True,
        heap_stamp: int = -1,
    ) -> None:
        # Written out (not dataclass-generated): no default factory call per node, and the
        # tree's insert builds one node per new chunk on the per-request path.
        self.key = key
        self.parent = parent
        self.depth = depth
        self.children = children
        self.token_start = token_start
        self.token_end = token_end
        self.location = location
        self.block_hashes = block_hashes
        self.hit_count = hit_count
        self.last_access = last_access
        self.alive = alive
        self.heap_stamp = heap_stamp

    def path(self) -> tuple[ChunkKey, ...]:
        """Chunk keys from the root to this node. O(depth)."""
        keys: list[ChunkKey] = []
        node: PrefixNode | None = self
        while node is not None and node.key is not None:
            keys.append(node.key)
            node = node.parent
        return tuple(reversed(keys))


_new = object.__new__


def new_leaf(
    key: ChunkKey,
    parent: PrefixNode,
    depth: int,
    token_start: int | None,
    token_end: int | None,
    location: KVLocation | None,
    now: float,
) -> PrefixNode:
    """``PrefixNode(key, parent, depth, NO_CHILDREN, token_start, token_end, location, (), 0,
    now)``, not yet linked, for the tree's insert: plain slot stores, no ``__init__`` call
    (~25% cheaper; one node per new chunk on the per-request path). O(1)."""
    node: PrefixNode = _new(PrefixNode)
    node.key = key
    node.parent = parent
    node.depth = depth
    node.children = NO_CHILDREN
    node.token_start = token_start
    node.token_end = token_end
    node.location = location
    node.block_hashes = ()
    node.hit_count = 0
    node.last_access = now
    node.alive = True
    node.heap_stamp = -1
    return node


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Result of a lookup: the matched nodes, root side first."""

    nodes: tuple[PrefixNode, ...]

    @property
    def length(self) -> int:
        return len(self.nodes)

    @property
    def keys(self) -> tuple[ChunkKey, ...]:
        return tuple(n.key for n in self.nodes if n.key is not None)

    @property
    def tokens(self) -> int | None:
        """Tokens of the matched prefix (end of the last node's span), None if unknown."""
        return self.nodes[-1].token_end if self.nodes else 0

    def sliced(self, length: int) -> PrefixMatch:
        """The sub-prefix of the first ``length`` chunks (prefix slicing; no storage)."""
        return PrefixMatch(self.nodes[:length])


@dataclass(frozen=True, slots=True)
class NodeMetadata:
    """Metadata to attach to one node on insert (any field left None is kept as is).

    Checked at construction: ``token_span`` is ``(start, end)`` ints with
    ``0 <= start <= end``; ``block_hashes`` are normalised by
    :func:`craft_rag.types.as_block_hash` (bytes, or ints as some vLLM servers report them).
    ``ValueError`` naming the field otherwise."""

    token_span: tuple[int, int] | None = None
    block_hashes: tuple[BlockHash, ...] | None = None

    def __post_init__(self) -> None:
        span = self.token_span
        if span is not None:
            if not isinstance(span, (tuple, list)) or len(span) != 2:
                msg = f"token_span: must be a (start, end) pair, got {span!r}"
                raise ValueError(msg)
            start = check_int(span[0], "token_span[0] (token span start)", minimum=0)
            end = check_int(span[1], "token_span[1] (token span end)", minimum=0)
            if start > end:
                msg = f"token_span: token span must satisfy 0 <= start <= end, got {span}"
                raise ValueError(msg)
            object.__setattr__(self, "token_span", (start, end))
        if self.block_hashes is not None:
            hashes = tuple(
                as_block_hash(h, f"block_hashes[{i}]")
                for i, h in enumerate(materialise(self.block_hashes, "block_hashes"))
            )
            object.__setattr__(self, "block_hashes", hashes)

    @classmethod
    def trusted(
        cls, token_span: tuple[int, int] | None, block_hashes: tuple[BlockHash, ...] | None
    ) -> NodeMetadata:
        """Metadata from values already checked where they entered (the planner's commit
        checks its arguments once per request): no re-check. Callers outside the core build
        :class:`NodeMetadata` normally. O(1)."""
        meta = object.__new__(cls)
        _SET_SPAN(meta, token_span)
        _SET_HASHES(meta, block_hashes)
        return meta


# Slot setters that bypass the frozen ``__setattr__`` (for :meth:`NodeMetadata.trusted`).
_SET_SPAN: Callable[[NodeMetadata, object], None] = NodeMetadata.__dict__["token_span"].__set__
_SET_HASHES: Callable[[NodeMetadata, object], None] = NodeMetadata.__dict__["block_hashes"].__set__


def block_hash_tuple(hashes: Iterable[BlockHash | int]) -> tuple[BlockHash, ...]:
    """KV-event hashes, read once and normalised before anything changes."""
    return tuple(
        as_block_hash(h, f"hashes[{i}]") for i, h in enumerate(materialise(hashes, "hashes"))
    )
