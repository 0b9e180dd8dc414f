"""Chunk-Prefix Tree (paper §4.1-4.2): lookup, slicing, set match, eviction, KV events."""

from __future__ import annotations

import json

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from craft_rag.prefix_tree import (
    ChunkPrefixTree,
    KVLocation,
    NodeMetadata,
    PrefixMatch,
    PrefixNode,
)
from craft_rag.testing import FakeClock
from craft_rag.types import BlockHash, ChunkKey

Path = tuple[str, ...]


class TickClock:
    """Advances by one on every read: no two reads return the same time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def ks(*names: str) -> list[ChunkKey]:
    return [ChunkKey(n) for n in names]


def bh(name: str) -> BlockHash:
    return BlockHash(name.encode())


def make_tree(
    max_nodes: int = 100, clock: FakeClock | TickClock | None = None
) -> ChunkPrefixTree:
    return ChunkPrefixTree(max_nodes, clock=clock or FakeClock())


def paths(tree: ChunkPrefixTree) -> set[Path]:
    return {tuple(p) for p in tree.iter_paths()}


# ---- lookup, slicing (paper §4.2 "Chunk-Prefix Lookup") ----------------------------------------


def test_paper_lookup_example_stops_at_first_missing_chunk() -> None:
    tree = make_tree()
    tree.insert(ks("C1", "C2"))
    match = tree.match(ks("C1", "C2", "C3"))
    assert match.keys == ("C1", "C2")
    assert match.length == 2
    assert tree.match(ks("C3", "C1", "C2")).length == 0  # C3 not at the first level: no reuse
    # C3 later inserted as a child of C2 forms the longer chunk-prefix
    tree.insert(ks("C1", "C2", "C3"))
    assert tree.match(ks("C1", "C2", "C3")).keys == ("C1", "C2", "C3")
    assert len(tree) == 3
    tree._check_invariants()


def test_paper_prefix_slicing_example() -> None:
    tree = make_tree()
    tree.insert(ks("C1", "C2", "C3"))
    assert tree.match(ks("C1")).keys == ("C1",)
    assert tree.match(ks("C1", "C2")).keys == ("C1", "C2")
    # [C1, C10, C11]: C10 and C11 are not in the tree, C1's KV is still reusable
    assert tree.match(ks("C1", "C10", "C11")).keys == ("C1",)
    full = tree.match(ks("C1", "C2", "C3"))
    assert full.sliced(2).keys == ("C1", "C2")
    assert full.sliced(0).length == 0
    assert len(tree) == 3  # slicing needs no extra storage


def test_match_has_no_side_effects() -> None:
    clock = FakeClock(5.0)
    tree = make_tree(clock=clock)
    tree.insert(ks("A", "B"))
    clock.tick()
    before = json.dumps(tree.to_json())
    tree.match(ks("A", "B"))
    tree.match_subset(ks("B", "A"))
    assert json.dumps(tree.to_json()) == before


def test_empty_lookups() -> None:
    tree = make_tree()
    assert tree.match([]).length == 0
    assert tree.match_subset([]).length == 0
    tree.insert(ks("A"))
    assert tree.match([]).keys == ()
    assert tree.match_subset(ks("Z")).keys == ()
    assert tree.insert([]).length == 0
    assert len(tree) == 1


def test_token_spans_and_match_tokens() -> None:
    tree = make_tree()
    tree.insert(
        ks("A", "B"),
        metadata=[NodeMetadata(token_span=(10, 30)), NodeMetadata(token_span=(30, 45))],
    )
    match = tree.match(ks("A", "B", "C"))
    assert match.tokens == 45
    assert match.sliced(1).tokens == 30
    assert tree.match(ks("Z")).tokens == 0
    tree.insert(ks("X"))  # no spans supplied: unknown
    assert tree.match(ks("X")).tokens is None
    tree._check_invariants()


def test_metadata_none_fields_keep_existing_values() -> None:
    tree = make_tree()
    tree.insert(ks("A"), metadata=[NodeMetadata(token_span=(0, 5), block_hashes=(bh("a"),))])
    tree.insert(ks("A"), metadata=[NodeMetadata()])
    node = tree.match(ks("A")).nodes[0]
    assert (node.token_start, node.token_end) == (0, 5)
    assert node.block_hashes == (bh("a"),)


def test_node_path_and_depth() -> None:
    tree = make_tree()
    tree.insert(ks("A", "B", "C"))
    nodes = tree.match(ks("A", "B", "C")).nodes
    assert [n.depth for n in nodes] == [1, 2, 3]
    assert nodes[2].path() == ("A", "B", "C")
    assert nodes[2].parent is nodes[1]
    assert tree.root.path() == ()


def test_insert_keeps_hits_and_refreshes_access() -> None:
    clock = FakeClock(1.0)
    tree = make_tree(clock=clock)
    tree.insert(ks("A", "B"))
    tree.touch(tree.match(ks("A", "B")))
    tree.touch(tree.match(ks("A")))
    a, b = tree.match(ks("A", "B")).nodes
    assert (a.hit_count, b.hit_count) == (2, 1)
    clock.tick(10)
    tree.insert(ks("A", "B", "C"))
    a, b, c = tree.match(ks("A", "B", "C")).nodes
    assert (a.hit_count, b.hit_count, c.hit_count) == (2, 1, 0)
    assert a.last_access == b.last_access == c.last_access == 11.0


def test_touch_ignores_dead_nodes() -> None:
    tree = make_tree()
    tree.insert(ks("A", "B"))
    stale = tree.match(ks("A", "B"))
    tree.remove(stale.nodes[1])
    tree.touch(stale)
    assert stale.nodes[0].hit_count == 1
    assert stale.nodes[1].hit_count == 0
    tree._check_invariants()


def test_insert_location_sets_every_node_on_the_path() -> None:
    tree = make_tree()
    gpu1 = KVLocation("gpu1", "device")
    tree.insert(ks("A", "B"), location=gpu1)
    assert all(n.location == gpu1 for n in tree.match(ks("A", "B")).nodes)
    tree.insert(ks("A"))  # no location given: kept
    assert tree.match(ks("A")).nodes[0].location == gpu1


# ---- bad input -----------------------------------------------------------------------------------


def test_insert_rejects_repeated_key() -> None:
    tree = make_tree()
    with pytest.raises(ValueError, match="repeat"):
        tree.insert(ks("A", "B", "A"))
    assert len(tree) == 0


def test_insert_rejects_metadata_length_mismatch() -> None:
    tree = make_tree()
    with pytest.raises(ValueError, match="metadata"):
        tree.insert(ks("A", "B"), metadata=[NodeMetadata()])


@pytest.mark.parametrize("span", [(-1, 3), (5, 4)])
def test_insert_rejects_bad_token_span(span: tuple[int, int]) -> None:
    tree = make_tree()
    with pytest.raises(ValueError, match="token span"):
        tree.insert(ks("A"), metadata=[NodeMetadata(token_span=span)])


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_bad_max_nodes(bad: object) -> None:
    with pytest.raises(ValueError, match="max_nodes"):
        ChunkPrefixTree(bad)


def test_cannot_remove_root() -> None:
    tree = make_tree()
    with pytest.raises(ValueError, match="root"):
        tree.remove(tree.root)


@pytest.mark.parametrize("data", [{}, {"format": "craft-rag/access-table/v1"}, []])
def test_foreign_json_is_rejected(data: object) -> None:
    with pytest.raises(ValueError, match="prefix tree"):
        ChunkPrefixTree.from_json(data)


def test_unicode_keys() -> None:
    tree = make_tree()
    tree.insert(ks("文書:0", "🗼", "é"))
    assert tree.match(ks("文書:0", "🗼", "x")).keys == ("文書:0", "🗼")
    loaded = ChunkPrefixTree.from_json(json.loads(json.dumps(tree.to_json())))
    assert paths(loaded) == paths(tree)


def test_deep_path_of_10000_chunks() -> None:
    tree = make_tree(max_nodes=20_000)
    keys = [ChunkKey(f"c{i}") for i in range(10_000)]
    tree.insert(keys)
    assert tree.match(keys).length == 10_000
    assert tree.match_subset(list(reversed(keys))).length == 10_000
    tree._check_invariants()
    loaded = ChunkPrefixTree.from_json(tree.to_json())
    assert loaded.match(keys).length == 10_000
    assert tree.remove(tree.match(keys[:1]).nodes[0]) == 10_000
    assert len(tree) == 0


# ---- removal and KV events (paper §4.2 "When a KV cache is evicted or moved") -------------------


def test_remove_takes_the_subtree() -> None:
    tree = make_tree()
    tree.insert(ks("A", "B", "C"))
    tree.insert(ks("A", "B", "D"))
    tree.insert(ks("A", "E"))
    b = tree.match(ks("A", "B")).nodes[1]
    assert tree.remove(b) == 3
    assert paths(tree) == {("A",), ("A", "E")}
    assert not b.alive
    assert tree.remove(b) == 0  # already gone
    tree._check_invariants()


def _insert_with_blocks(tree: ChunkPrefixTree, names: list[str]) -> None:
    tree.insert(
        ks(*names),
        metadata=[NodeMetadata(block_hashes=(bh(f"{n}-0"), bh(f"{n}-1"))) for n in names],
    )


def test_remove_blocks_drops_owner_and_descendants_ignores_unknown() -> None:
    tree = make_tree()
    _insert_with_blocks(tree, ["A", "B", "C"])
    assert tree.remove_blocks([bh("nope"), bh("B-1")]) == 2
    assert paths(tree) == {("A",)}
    assert tree.remove_blocks([bh("B-0"), bh("C-0")]) == 0  # their nodes are gone
    tree._check_invariants()
    assert tree.remove_blocks([bh("A-0"), bh("A-1")]) == 1
    assert len(tree) == 0
    tree._check_invariants()


def test_relocate_blocks_counts_nodes_that_moved() -> None:
    tree = make_tree()
    gpu = KVLocation("gpu1", "device")
    cpu = KVLocation("gpu1", "cpu")
    tree.insert(ks("A", "B"), location=gpu)
    _insert_with_blocks(tree, ["A", "B"])
    assert tree.relocate_blocks([bh("A-0"), bh("A-1"), bh("zzz")], cpu) == 1
    a, b = tree.match(ks("A", "B")).nodes
    assert a.location == cpu and b.location == gpu
    assert tree.relocate_blocks([bh("A-0")], cpu) == 0  # already there
    tree._check_invariants()


def test_new_block_hashes_replace_old_ones_in_the_index() -> None:
    tree = make_tree()
    tree.insert(ks("A"), metadata=[NodeMetadata(block_hashes=(bh("old"),))])
    tree.insert(ks("A"), metadata=[NodeMetadata(block_hashes=(bh("new"),))])
    assert tree.remove_blocks([bh("old")]) == 0
    assert tree.remove_blocks([bh("new")]) == 1
    tree._check_invariants()


def test_a_block_hash_claimed_by_a_second_node_moves_to_it() -> None:
    # A block hash names one KV block, so it can belong to one node only. If an engine reports
    # it again for another node, the later claim wins and the index stays consistent.
    tree = make_tree()
    tree.insert(ks("A"), metadata=[NodeMetadata(block_hashes=(bh("h"), bh("a")))])
    tree.insert(ks("B"), metadata=[NodeMetadata(block_hashes=(bh("h"),))])
    tree._check_invariants()
    assert tree.remove_blocks([bh("h")]) == 1
    assert paths(tree) == {("A",)}
    tree._check_invariants()
    assert tree.remove_blocks([bh("a")]) == 1
    tree._check_invariants()


def test_clear() -> None:
    tree = make_tree()
    _insert_with_blocks(tree, ["A", "B"])
    old = tree.match(ks("A")).nodes[0]
    tree.clear()
    assert len(tree) == 0 and not old.alive
    assert tree.remove_blocks([bh("A-0")]) == 0
    tree._check_invariants()
    tree.insert(ks("A"))
    assert len(tree) == 1


# ---- set match (the `tree` policy's lookup) ------------------------------------------------------


def test_match_subset_finds_the_longest_path_inside_the_set() -> None:
    tree = make_tree()
    tree.insert(ks("A", "B", "C"))
    tree.insert(ks("B", "D"))
    assert tree.match_subset(ks("C", "B", "A", "Z")).keys == ("A", "B", "C")
    assert tree.match_subset(ks("D", "B")).keys == ("B", "D")
    assert tree.match_subset(ks("B", "C")).keys == ("B",)  # [A,B,C] needs A
    assert tree.match_subset(ks("A", "C")).keys == ("A",)


def test_match_subset_ties_prefer_recent_then_smaller_path() -> None:
    clock = FakeClock(1.0)
    tree = make_tree(clock=clock)
    tree.insert(ks("B", "A"))
    tree.insert(ks("A", "B"))  # same time: the smaller key sequence wins
    assert tree.match_subset(ks("A", "B")).keys == ("A", "B")
    clock.tick()
    tree.touch(tree.match(ks("B", "A")))  # now [B, A] is more recent
    assert tree.match_subset(ks("A", "B")).keys == ("B", "A")
    assert tree.match_subset({ChunkKey("A"), ChunkKey("B")}).keys == ("B", "A")  # a set works too


# ---- eviction: least recently accessed leaf first ------------------------------------------------


def test_eviction_is_least_recently_accessed_leaf_first() -> None:
    clock = FakeClock()
    tree = make_tree(max_nodes=3, clock=clock)
    for name in ("A", "B", "C"):
        clock.tick()
        tree.insert(ks(name))  # A@1, B@2, C@3
    clock.tick()
    tree.touch(tree.match(ks("A")))  # A@4
    clock.tick()
    tree.insert(ks("D"))  # evicts B (oldest)
    assert paths(tree) == {("A",), ("C",), ("D",)}
    clock.tick()
    tree.insert(ks("E"))  # evicts C
    assert paths(tree) == {("A",), ("D",), ("E",)}
    clock.tick()
    tree.insert(ks("F"))  # evicts A (touched at 4, older than D@5)
    assert paths(tree) == {("D",), ("E",), ("F",)}
    assert tree.evictions == 3
    tree._check_invariants()


def test_eviction_removes_a_cold_branch_leaf_by_leaf() -> None:
    clock = FakeClock()
    tree = make_tree(max_nodes=4, clock=clock)
    clock.tick()
    tree.insert(ks("A", "B", "C"))  # @1
    clock.tick()
    tree.insert(ks("D"))  # @2
    evicted_order = []
    for name in ("E", "F", "G", "H"):
        clock.tick()
        before = paths(tree)
        tree.insert(ks(name))
        evicted_order += sorted(before - paths(tree))
    assert evicted_order == [("A", "B", "C"), ("A", "B"), ("A",), ("D",)]
    tree._check_invariants()


def test_inner_nodes_of_a_hot_path_survive() -> None:
    clock = FakeClock()
    tree = make_tree(max_nodes=3, clock=clock)
    clock.tick()
    tree.insert(ks("A", "B"))  # @1
    clock.tick()
    tree.insert(ks("A", "C"))  # A@2, C@2; B is the cold leaf
    clock.tick()
    tree.insert(ks("A", "D"))  # evicts B, never A
    assert paths(tree) == {("A",), ("A", "C"), ("A", "D")}
    tree._check_invariants()


def test_just_inserted_path_is_not_evicted_even_when_oldest() -> None:
    clock = FakeClock(10.0)
    tree = make_tree(max_nodes=2, clock=clock)
    tree.insert(ks("A"))
    tree.insert(ks("B"))
    clock.now = 0.0  # a clock that went backwards: the new leaf is the "oldest"
    tree.insert(ks("C"))
    assert ("C",) in paths(tree)
    assert len(tree) == 2
    tree._check_invariants()


def test_path_longer_than_the_bound_is_trimmed_from_its_leaf_end() -> None:
    tree = make_tree(max_nodes=2)
    tree.insert(ks("X"))
    result = tree.insert(ks("A", "B", "C"))
    assert paths(tree) == {("A",), ("A", "B")}
    assert result.keys == ("A", "B")
    tree._check_invariants()


def test_equal_times_evict_in_insertion_order() -> None:
    tree = make_tree(max_nodes=3, clock=FakeClock(0.0))
    for name in ("A", "B", "C", "D", "E"):
        tree.insert(ks(name))
    assert paths(tree) == {("C",), ("D",), ("E",)}


def test_round_trip_keeps_the_eviction_order_under_a_coarse_clock() -> None:
    # A coarse clock gives many equal access times. The loaded tree must evict in the same order
    # as the original, or save/load changes future plans.
    tree = make_tree(max_nodes=3, clock=FakeClock(0.0))
    for name in ("A", "B", "C"):
        tree.insert(ks(name))
    loaded = ChunkPrefixTree.from_json(json.loads(json.dumps(tree.to_json())), clock=FakeClock())
    for t in (tree, loaded):
        t.insert(ks("D"))
        t._check_invariants()
    assert paths(loaded) == paths(tree) == {("B",), ("C",), ("D",)}


def test_heap_rebuild_keeps_the_eviction_order() -> None:
    # Many touches of one leaf grow the lazy heap until it is rebuilt; the rebuild must not
    # reshuffle leaves that share an access time.
    tree = make_tree(max_nodes=3, clock=FakeClock(0.0))
    for name in ("A", "B", "C"):
        tree.insert(ks(name))
    for _ in range(200):
        tree.touch(tree.match(ks("C")))
    tree.insert(ks("D"))
    assert paths(tree) == {("B",), ("C",), ("D",)}


def test_json_round_trip_is_exact() -> None:
    clock = FakeClock(3.0)
    tree = make_tree(max_nodes=50, clock=clock)
    tree.insert(
        ks("A", "B"),
        metadata=[
            NodeMetadata(token_span=(4, 9), block_hashes=(bh("x"),)),
            NodeMetadata(token_span=(9, 20), block_hashes=(bh("y"), bh("z"))),
        ],
        location=KVLocation("replica-2", "cpu"),
    )
    clock.tick()
    tree.insert(ks("A", "C"))
    tree.touch(tree.match(ks("A", "B")))
    data = json.loads(json.dumps(tree.to_json()))
    loaded = ChunkPrefixTree.from_json(data, clock=clock)
    loaded._check_invariants()
    assert loaded.to_json() == tree.to_json()
    assert loaded.max_nodes == 50
    b = loaded.match(ks("A", "B")).nodes[1]
    assert (b.token_start, b.token_end, b.hit_count, b.last_access) == (9, 20, 1, 4.0)
    assert b.location == KVLocation("replica-2", "cpu")
    assert loaded.remove_blocks([bh("z")]) == 1


def test_prefix_match_of_no_nodes() -> None:
    empty = PrefixMatch(())
    assert empty.length == 0 and empty.keys == () and empty.tokens == 0


def test_prefix_node_is_slotted() -> None:
    node = PrefixNode(key=None, parent=None, depth=0)
    with pytest.raises(AttributeError):
        node.extra = 1


# ---- state machine: the tree against a brute-force model -----------------------------------------

NAMES = ["A", "B", "C", "D", "E"]
path_strategy = st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True).map(tuple)
query_strategy = st.lists(st.sampled_from([*NAMES, "Z"]), max_size=6)


def path_hash(path: Path, variant: int, block: int) -> BlockHash:
    return BlockHash(f"{'/'.join(path)}#{variant}.{block}".encode())


class TreeModel:
    """Every present chunk-prefix with its last access, hits, hashes and location; eviction is
    re-derived from scratch (the leaf with the oldest access that is not the new path)."""

    def __init__(self, max_nodes: int) -> None:
        self.max_nodes = max_nodes
        self.access: dict[Path, float] = {}
        self.hits: dict[Path, int] = {}
        self.hashes: dict[Path, tuple[BlockHash, ...]] = {}
        self.location: dict[Path, KVLocation | None] = {}
        self.evictions = 0

    def is_leaf(self, p: Path) -> bool:
        return not any(len(q) == len(p) + 1 and q[: len(p)] == p for q in self.access)

    def remove_subtree(self, p: Path) -> int:
        doomed = [q for q in self.access if q[: len(p)] == p]
        for q in doomed:
            del self.access[q], self.hits[q], self.hashes[q], self.location[q]
        return len(doomed)

    def insert(
        self,
        path: Path,
        now: float,
        hashes: list[tuple[BlockHash, ...]] | None,
        location: KVLocation | None,
    ) -> Path:
        for i in range(1, len(path) + 1):
            p = path[:i]
            if p not in self.access:
                self.hits[p], self.hashes[p], self.location[p] = 0, (), None
            self.access[p] = now
            if location is not None:
                self.location[p] = location
            if hashes is not None:
                self.hashes[p] = hashes[i - 1]
        protect: Path = path
        while len(self.access) > self.max_nodes:
            leaves = [p for p in self.access if p != protect and self.is_leaf(p)]
            if not leaves:
                break
            self.remove_subtree(min(leaves, key=self.access.__getitem__))
            self.evictions += 1
        while len(self.access) > self.max_nodes and protect:
            self.remove_subtree(protect)
            self.evictions += 1
            protect = protect[:-1]
        return next((path[:i] for i in range(len(path), 0, -1) if path[:i] in self.access), ())

    def match(self, query: list[str]) -> Path:
        best: Path = ()
        for p in self.access:
            if len(p) > len(best) and tuple(query[: len(p)]) == p:
                best = p
        return best

    def match_subset(self, query: list[str]) -> Path:
        wanted = set(query)
        candidates = [p for p in self.access if set(p) <= wanted]
        if not candidates:
            return ()
        depth = max(map(len, candidates))
        deepest = [p for p in candidates if len(p) == depth]
        latest = max(self.access[p] for p in deepest)
        return min(p for p in deepest if self.access[p] == latest)

    def owner(self, h: BlockHash) -> Path | None:
        return next((p for p, hs in self.hashes.items() if h in hs), None)


class PrefixTreeMachine(RuleBasedStateMachine):
    @initialize(max_nodes=st.integers(min_value=1, max_value=8))
    def setup(self, max_nodes: int) -> None:
        self.clock = TickClock()
        self.tree = ChunkPrefixTree(max_nodes, clock=self.clock)
        self.model = TreeModel(max_nodes)

    def ready(self) -> bool:
        return hasattr(self, "tree")

    @precondition(ready)
    @rule(
        inserts=st.lists(
            st.tuples(
                path_strategy,
                st.integers(0, 1),
                st.booleans(),
                st.sampled_from([None, KVLocation("g0"), KVLocation("g1", "cpu")]),
            ),
            min_size=1,
            max_size=4,
        )
    )
    def insert(self, inserts: list[tuple[Path, int, bool, KVLocation | None]]) -> None:
        for path, variant, with_hashes, where in inserts:
            hashes = (
                [(path_hash(path[:i], variant, 0), path_hash(path[:i], variant, 1))
                 for i in range(1, len(path) + 1)]
                if with_hashes
                else None
            )
            metadata = [NodeMetadata(block_hashes=h) for h in hashes] if hashes else None
            result = self.tree.insert(ks(*path), metadata=metadata, location=where)
            expected = self.model.insert(path, self.clock.now, hashes, where)
            assert result.keys == expected

    def draw_query(self, data: st.DataObject) -> list[str]:
        """A random query, or one built from present paths (so long matches and ties occur)."""
        present = sorted(self.model.access)
        kind = data.draw(st.sampled_from(["random", "path", "union"] if present else ["random"]))
        if kind == "random":
            return data.draw(query_strategy)
        first = list(data.draw(st.sampled_from(present)))
        if kind == "union":  # two paths of one depth: the set match must break the tie
            same_depth = [p for p in present if len(p) == len(first) and list(p) != first]
            same_depth = same_depth or present
            first += [k for k in data.draw(st.sampled_from(same_depth)) if k not in first]
        extra = data.draw(st.lists(st.sampled_from([*NAMES, "Z"]), max_size=2))
        query = first + extra
        if data.draw(st.booleans()):
            query = data.draw(st.permutations(query))
        return list(query)

    @precondition(ready)
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        query = self.draw_query(data)
        match = self.tree.match(ks(*query))
        self.tree.touch(match)
        found = self.model.match(query)
        assert match.keys == found
        for i in range(1, len(found) + 1):
            self.model.access[found[:i]] = self.clock.now
            self.model.hits[found[:i]] += 1

    @precondition(ready)
    @rule(data=st.data())
    def lookups_equal_brute_force(self, data: st.DataObject) -> None:
        query = self.draw_query(data)
        assert self.tree.match(ks(*query)).keys == self.model.match(query)
        assert self.tree.match_subset(ks(*query)).keys == self.model.match_subset(query)

    @precondition(ready)
    @rule(
        victims=st.lists(st.tuples(path_strategy, st.integers(0, 1), st.integers(0, 1)), max_size=3)
    )
    def remove_blocks(self, victims: list[tuple[Path, int, int]]) -> None:
        hashes = [path_hash(p, v, b) for p, v, b in victims]
        expected = 0
        for h in hashes:
            owner = self.model.owner(h)
            if owner is not None:
                expected += self.model.remove_subtree(owner)
        assert self.tree.remove_blocks(hashes) == expected

    @precondition(ready)
    @rule(
        victims=st.lists(
            st.tuples(path_strategy, st.integers(0, 1), st.integers(0, 1)), max_size=3
        ),
        where=st.sampled_from([KVLocation("g0"), KVLocation("g1", "cpu")]),
    )
    def relocate_blocks(self, victims: list[tuple[Path, int, int]], where: KVLocation) -> None:
        hashes = [path_hash(p, v, b) for p, v, b in victims]
        expected = 0
        for h in hashes:
            owner = self.model.owner(h)
            if owner is not None and self.model.location[owner] != where:
                self.model.location[owner] = where
                expected += 1
        assert self.tree.relocate_blocks(hashes, where) == expected

    @precondition(ready)
    @rule(data=st.data())
    def remove_node(self, data: st.DataObject) -> None:
        match = self.tree.match(ks(*self.draw_query(data)))
        if match.length == 0:
            return
        node = match.nodes[-1]
        assert self.tree.remove(node) == self.model.remove_subtree(match.keys)

    @precondition(lambda self: hasattr(self, "tree") and len(self.tree) == self.tree.max_nodes)
    @rule()
    def clear(self) -> None:
        self.tree.clear()
        self.model.remove_subtree(())

    @precondition(ready)
    @rule()
    def round_trip(self) -> None:
        data = json.loads(json.dumps(self.tree.to_json()))
        evictions = self.tree.evictions
        self.tree = ChunkPrefixTree.from_json(data, clock=self.clock)
        self.tree.evictions = evictions
        assert self.tree.to_json() == data

    @precondition(ready)
    @invariant()
    def tree_equals_model(self) -> None:
        self.tree._check_invariants()
        assert paths(self.tree) == set(self.model.access)
        assert len(self.tree) == len(self.model.access) <= self.model.max_nodes
        assert self.tree.evictions == self.model.evictions
        stack = list(self.tree.root.children.values())
        while stack:
            node = stack.pop()
            p = node.path()
            assert node.last_access == self.model.access[p]
            assert node.hit_count == self.model.hits[p]
            assert node.block_hashes == self.model.hashes[p]
            assert node.location == self.model.location[p]
            stack.extend(node.children.values())


PrefixTreeMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None
)
TestPrefixTreeMachine = PrefixTreeMachine.TestCase


def test_reinserting_an_unchanged_span_keeps_the_children_a_changed_one_drops_them() -> None:
    # Issue 16: the stale-children scan runs only when a node's span end changes.
    tree = ChunkPrefixTree(100)
    span = [NodeMetadata(token_span=(0, 10)), NodeMetadata(token_span=(10, 20))]
    tree.insert(ks("A", "B"), metadata=span)
    tree.insert(ks("A", "C"), metadata=span)
    tree.insert(ks("A"), metadata=span[:1])
    assert sorted(tree.iter_paths()) == [("A",), ("A", "B"), ("A", "C")]
    tree.insert(ks("A"), metadata=[NodeMetadata(token_span=(0, 12))])
    assert tree.iter_paths() == [("A",)]
    tree._check_invariants()
