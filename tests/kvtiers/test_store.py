"""TieredBlockStore: capacity, leaf-only eviction, copy-down, pins, verification, restart."""

from __future__ import annotations

import os
import random
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from craft_rag.kvtiers import disk_tier
from craft_rag.kvtiers.cost_model import PrefillCostModel
from craft_rag.kvtiers.keys import BlockKey, chain_keys
from craft_rag.kvtiers.store import TieredBlockStore
from craft_rag.kvtiers.tier_types import Tier

BLOCK = 4
SIZE = 100


class Chain:
    """A prompt's full blocks: keys, parents, token ids and payloads."""

    def __init__(self, tokens: list[int], salt: str | None = None, size: int = SIZE) -> None:
        self.keys = chain_keys(tokens, BLOCK, salt)
        self.tokens = [tokens[i * BLOCK : (i + 1) * BLOCK] for i in range(len(self.keys))]
        self.payloads = [
            bytes([(tokens[i * BLOCK] + i) % 256]) * size for i in range(len(self.keys))
        ]

    def parent(self, i: int) -> BlockKey | None:
        return self.keys[i - 1] if i else None

    def put(self, store: TieredBlockStore, i: int) -> bool:
        return store.put(self.keys[i], self.parent(i), self.tokens[i], self.payloads[i], i * BLOCK)

    def put_all(self, store: TieredBlockStore) -> list[bool]:
        return [self.put(store, i) for i in range(len(self.keys))]

    def get(self, store: TieredBlockStore, i: int) -> bytes | None:
        return store.get(self.keys[i], self.tokens[i])


def make_chain(start: int, blocks: int, salt: str | None = None) -> Chain:
    return Chain(list(range(start, start + blocks * BLOCK)), salt)


@pytest.fixture
def tier_dir(tmp_path: Path) -> Path:
    return tmp_path / "tiers"


@pytest.fixture
def store(tier_dir: Path) -> Iterator[TieredBlockStore]:
    with TieredBlockStore(3 * SIZE, 4 * SIZE, tier_dir, policy="lru") as s:
        yield s


def files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.name.endswith(".kv")}


def test_put_get_lookup_round_trip(store: TieredBlockStore) -> None:
    chain = make_chain(0, 3)
    assert chain.put_all(store) == [True, True, True]
    assert chain.put(store, 0) is False  # idempotent
    assert store.lookup(chain.keys) == [Tier.RAM] * 3
    assert [chain.get(store, i) for i in range(3)] == chain.payloads
    stats = store.stats()
    assert (stats.ram_entries, stats.ram_bytes, stats.ram_hits) == (3, 3 * SIZE, 3)
    store._check_invariants()


def test_peek_reads_ram_without_counting_an_access(store: TieredBlockStore) -> None:
    """peek (chunk-cache read-back) returns the RAM payload and changes no counter; it refuses
    a token mismatch and an absent key."""
    chain = make_chain(0, 2)
    chain.put_all(store)
    before = store.stats()
    assert store.peek(chain.keys[1], chain.tokens[1]) == chain.payloads[1]
    assert store.peek(chain.keys[1], chain.tokens[0]) is None  # wrong tokens
    assert store.peek(make_chain(90, 1).keys[0], chain.tokens[1]) is None  # absent
    after = store.stats()
    assert (after.ram_hits, after.ram_misses, after.disk_hits, after.token_mismatches) == (
        before.ram_hits, before.ram_misses, before.disk_hits, before.token_mismatches)
    store._check_invariants()


def test_lookup_stops_at_the_first_missing_key(store: TieredBlockStore) -> None:
    chain = make_chain(0, 3)
    chain.put(store, 0)
    chain.put(store, 2)
    assert store.lookup(chain.keys) == [Tier.RAM]
    assert store.lookup(chain.keys[1:]) == []


def test_capacity_is_exact_and_eviction_copies_down_once(
    store: TieredBlockStore, tier_dir: Path
) -> None:
    chain = make_chain(0, 4)
    chain.put_all(store)
    store.flush()
    # RAM is full and its only leaf is block 3's parent, which is never evicted for its child:
    # block 3 goes straight to disk (parents sit in the faster tier, as in RAGCache)
    assert store.lookup(chain.keys) == [Tier.RAM, Tier.RAM, Tier.RAM, Tier.DISK]
    assert files(tier_dir) == {chain.keys[3].hex() + ".kv"}
    other, third = make_chain(1000, 1), make_chain(2000, 1)
    other.put(store, 0)  # evicts RAM leaf block 2, copied down
    store.flush()
    stats = store.stats()
    assert (stats.ram_bytes, stats.ram_evictions, stats.copy_downs) == (3 * SIZE, 1, 1)
    # a disk hit is promoted; its RAM parent (block 1, a leaf) is kept, so `other` goes down
    assert chain.get(store, 2) == chain.payloads[2]
    assert store.lookup(chain.keys) == [Tier.RAM, Tier.RAM, Tier.RAM, Tier.DISK]
    assert store.lookup(other.keys) == [Tier.DISK]
    third.put(store, 0)  # the only RAM leaf is block 2: already on disk, not written again
    store.flush()
    stats = store.stats()
    assert (stats.ram_evictions, stats.copy_downs, stats.disk_writes) == (3, 2, 3)
    assert (stats.disk_hits, stats.promotions, stats.disk_bytes) == (1, 1, 3 * SIZE)
    assert files(tier_dir) == {k.hex() + ".kv" for k in (*chain.keys[2:], *other.keys)}
    store._check_invariants(check_files=True)


def test_leaf_only_eviction_keeps_prefixes(tier_dir: Path) -> None:
    with TieredBlockStore(3 * SIZE, 0, None, policy="lru") as s:
        a = make_chain(0, 2)
        a.put_all(s)  # a0 <- a1
        b = make_chain(500, 1)
        b.put(s, 0)
        a.get(s, 0)  # a0 is now the most recent, but it is not a leaf anyway
        c = make_chain(900, 1)
        c.put(s, 0)  # leaves: a1 (older), b0 -> a1 goes, a0 stays though it is older than b0
        assert s.lookup(a.keys) == [Tier.RAM]
        assert s.lookup(b.keys) == [Tier.RAM]
        s._check_invariants()


def test_entry_larger_than_both_tiers_is_refused(store: TieredBlockStore) -> None:
    big = Chain(list(range(BLOCK)), size=5 * SIZE)
    assert big.put(store, 0) is False
    assert store.stats().ram_entries == 0


def test_disk_only_and_ram_only_stores(tier_dir: Path) -> None:
    chain = make_chain(0, 2)
    with TieredBlockStore(0, 2 * SIZE, tier_dir) as s:
        assert chain.put_all(s) == [True, True]
        assert s.lookup(chain.keys) == [Tier.DISK, Tier.DISK]
        s.flush()
        assert chain.get(s, 1) == chain.payloads[1]
        assert s.stats().disk_hits == 1 and s.stats().promotions == 0
    with TieredBlockStore(SIZE, 0, None) as s:
        assert chain.put_all(s) == [True, False]  # block 0 is not evicted for its own child
        s._check_invariants()


def test_bad_arguments(tier_dir: Path) -> None:
    with pytest.raises(ValueError, match="disk_dir"):
        TieredBlockStore(1, 10, None)
    with pytest.raises(ValueError, match="disk_dir"):
        TieredBlockStore(1, 0, tier_dir)
    with pytest.raises(ValueError, match=">= 0"):
        TieredBlockStore(-1, 0, None)
    with pytest.raises(ValueError, match="lru, pgdsf"):
        TieredBlockStore(1, 0, None, policy="fifo")
    with TieredBlockStore(SIZE, 0, None) as s:
        with pytest.raises(ValueError, match="32-byte"):
            s.put(BlockKey(b"short"), None, [1], b"x", 0)
        with pytest.raises(ValueError):
            s.put(make_chain(0, 1).keys[0], None, [], b"x", 0)
    with pytest.raises(RuntimeError, match="closed"):
        make_chain(0, 1).put(s, 0)


def test_pinned_entries_are_never_evicted(tier_dir: Path) -> None:
    with TieredBlockStore(2 * SIZE, 0, None, policy="lru") as s:
        a, b, c = make_chain(0, 1), make_chain(100, 1), make_chain(200, 1)
        a.put(s, 0)
        b.put(s, 0)
        assert s.lookup_and_pin(a.keys) == [Tier.RAM]
        s.pin(b.keys)
        assert c.put(s, 0) is False  # both pinned
        s.unpin(b.keys)
        assert c.put(s, 0) is True  # b (unpinned) went, a stayed though it is older
        assert s.lookup(a.keys) == [Tier.RAM] and s.lookup(b.keys) == []
        s.unpin(a.keys)
        with pytest.raises(RuntimeError, match="pin"):
            s.unpin(a.keys)
        with pytest.raises(KeyError):
            s.pin(b.keys)
        s._check_invariants()


def test_salts_never_share_entries(store: TieredBlockStore) -> None:
    tokens = list(range(2 * BLOCK))
    a, b = Chain(tokens, "tenant-a"), Chain(tokens, "tenant-b")
    a.put_all(store)
    assert store.lookup(b.keys) == []
    assert store.get(b.keys[0], b.tokens[0]) is None
    assert b.put_all(store) == [True, True]
    assert store.stats().ram_entries + store.stats().disk_entries == 4


def test_token_id_mismatch_returns_none_and_keeps_the_entry(store: TieredBlockStore) -> None:
    chain = make_chain(0, 1)
    chain.put(store, 0)
    assert store.get(chain.keys[0], [9, 9, 9, 9]) is None
    assert store.stats().token_mismatches == 1
    assert chain.get(store, 0) == chain.payloads[0]


def disk_store(tier_dir: Path, blocks: int = 2) -> tuple[TieredBlockStore, Chain]:
    s = TieredBlockStore(0, 4 * SIZE, tier_dir, policy="lru")
    chain = make_chain(0, blocks)
    chain.put_all(s)
    s.flush()
    return s, chain


def test_a_flipped_byte_means_none_and_a_corrupt_drop(tier_dir: Path) -> None:
    s, chain = disk_store(tier_dir)
    path = disk_tier.block_path(tier_dir.resolve(), chain.keys[1])
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01  # inside the payload
    path.write_bytes(bytes(data))
    assert chain.get(s, 1) is None
    assert s.stats().corrupt_drops == 1
    assert s.lookup(chain.keys) == [Tier.DISK]
    assert not path.exists()
    assert chain.get(s, 0) == chain.payloads[0]
    s._check_invariants(check_files=True)
    s.close()


@pytest.mark.parametrize("damage", ["truncate", "header", "missing", "swap"])
def test_damaged_files_are_never_served(tier_dir: Path, damage: str) -> None:
    s, chain = disk_store(tier_dir)
    folder = tier_dir.resolve()
    path = disk_tier.block_path(folder, chain.keys[1])
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-10])
    elif damage == "header":
        data = bytearray(path.read_bytes())
        data[90] ^= 0xFF  # a token id
        path.write_bytes(bytes(data))
    elif damage == "missing":
        path.unlink()
    else:  # another block's valid file under this name: foreign content
        os.replace(disk_tier.block_path(folder, chain.keys[0]), path)
    assert chain.get(s, 1) is None
    assert s.stats().corrupt_drops == 1
    s.close()


def test_private_permissions(tier_dir: Path) -> None:
    s, _chain = disk_store(tier_dir)
    assert stat.S_IMODE(tier_dir.stat().st_mode) == 0o700
    for name in files(tier_dir):
        assert stat.S_IMODE((tier_dir / name).stat().st_mode) == 0o600
    s.close()


def test_a_shared_or_symlinked_directory_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(PermissionError, match="chmod 700"):
        TieredBlockStore(0, SIZE, shared)
    link = tmp_path / "link"
    link.symlink_to(shared)
    with pytest.raises(NotADirectoryError):
        TieredBlockStore(0, SIZE, link)
    with pytest.raises(FileNotFoundError):
        TieredBlockStore(0, SIZE, tmp_path / "no" / "such")


def test_warm_restart_rebuilds_the_index(tier_dir: Path) -> None:
    chain = make_chain(0, 3)
    with TieredBlockStore(3 * SIZE, 4 * SIZE, tier_dir) as s:
        chain.put_all(s)  # RAM only until close copies them down
    (tier_dir / "notes.txt").write_text("not ours")
    (tier_dir / ("ab" * 32 + ".kv")).write_bytes(b"XXXX not our magic")
    with TieredBlockStore(3 * SIZE, 4 * SIZE, tier_dir) as s:
        assert s.lookup(chain.keys) == [Tier.DISK] * 3
        assert [chain.get(s, i) for i in range(3)] == chain.payloads
        s._check_invariants(check_files=True)
        assert s.stats().corrupt_drops == 0
    assert (tier_dir / "notes.txt").exists()
    assert (tier_dir / ("ab" * 32 + ".kv")).exists()


def test_restart_drops_corrupt_headers_and_respects_a_smaller_size(tier_dir: Path) -> None:
    s, chain = disk_store(tier_dir, blocks=4)
    s.close()
    path = disk_tier.block_path(tier_dir.resolve(), chain.keys[3])
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01  # inside the key field of the header
    path.write_bytes(bytes(data))
    with TieredBlockStore(0, 2 * SIZE, tier_dir, policy="lru") as s2:
        assert s2.stats().corrupt_drops == 1
        assert not path.exists()
        assert s2.lookup(chain.keys) == [Tier.DISK, Tier.DISK]  # leaf-first down to 2 blocks
        s2._check_invariants(check_files=True)
    assert len(files(tier_dir)) == 2


def test_concurrent_puts_and_gets(tier_dir: Path) -> None:
    chains = [make_chain(1000 * t, 6) for t in range(4)]
    errors: list[BaseException] = []
    with TieredBlockStore(6 * SIZE, 12 * SIZE, tier_dir) as s:

        def work(chain: Chain) -> None:
            try:
                for _ in range(20):
                    chain.put_all(s)
                    for i in range(6):
                        got = chain.get(s, i)
                        assert got is None or got == chain.payloads[i]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(c,)) for c in chains]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        s.flush()
        s._check_invariants(check_files=True)
    assert errors == []


@pytest.mark.parametrize("policy", ["lru", "pgdsf"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seeded_stress_keeps_invariants(tier_dir: Path, policy: str, seed: int) -> None:
    rng = random.Random(seed)
    # chains share prefixes of 0-3 blocks, so entries have several children per tier
    trunk = list(range(5000, 5000 + 3 * BLOCK))
    chains = [make_chain(100 * c, 5) for c in range(3)]
    for c in range(3):
        shared = trunk[: rng.randrange(4) * BLOCK]
        tail = list(range(200 * (c + 10), 200 * (c + 10) + 5 * BLOCK - len(shared)))
        chains.append(Chain(shared + tail))
    pinned: list[BlockKey] = []
    with TieredBlockStore(4 * SIZE, 6 * SIZE, tier_dir, policy=policy) as s:
        for _ in range(400):
            chain = rng.choice(chains)
            i = rng.randrange(5)
            action = rng.random()
            if action < 0.45:
                chain.put(s, i)
            elif action < 0.8:
                got = chain.get(s, i)
                assert got is None or got == chain.payloads[i]
            elif action < 0.88 and s.lookup(chain.keys[i : i + 1]):
                s.pin(chain.keys[i : i + 1])
                pinned.append(chain.keys[i])
            elif action < 0.96 and pinned:
                s.unpin([pinned.pop(rng.randrange(len(pinned)))])
            else:
                s.flush()
                s._check_invariants(check_files=True)
            s._check_invariants()
        s.unpin(pinned)
        stats = s.stats()
        assert stats.ram_evictions > 0 and stats.disk_evictions > 0


def test_close_persists_prefixes_first_when_disk_is_smaller(tier_dir: Path) -> None:
    chain = make_chain(0, 3)
    with TieredBlockStore(3 * SIZE, 2 * SIZE, tier_dir, policy="lru") as s:
        chain.put_all(s)
    with TieredBlockStore(3 * SIZE, 2 * SIZE, tier_dir, policy="lru") as s:
        # block 2 could only be written by evicting its parent: it is dropped instead
        assert s.lookup(chain.keys) == [Tier.DISK, Tier.DISK]
        assert s.lookup(chain.keys[2:]) == []


def test_a_block_larger_than_ram_goes_to_disk(tier_dir: Path) -> None:
    with TieredBlockStore(SIZE, 4 * SIZE, tier_dir) as s:
        big = Chain(list(range(BLOCK)), size=2 * SIZE)
        assert big.put(s, 0) is True
        assert s.lookup(big.keys) == [Tier.DISK]
        s.flush()
        assert big.get(s, 0) == big.payloads[0]
        assert s.stats().promotions == 0  # does not fit RAM


def test_frequency_survives_copy_down_and_promotion(tier_dir: Path) -> None:
    with TieredBlockStore(SIZE, 4 * SIZE, tier_dir, policy="pgdsf") as s:
        a, b = make_chain(0, 1), make_chain(500, 1)
        a.put(s, 0)
        for _ in range(3):
            a.get(s, 0)
        b.put(s, 0)  # a (4 uses) is copied down
        assert s._policies[Tier.DISK].frequency(a.keys[0]) == 4
        s.flush()
        a.get(s, 0)  # disk hit: 5 uses, promoted with them
        assert s._policies[Tier.RAM].frequency(a.keys[0]) == 5


def test_pgdsf_store_keeps_late_prefix_blocks_that_lru_drops(tmp_path: Path) -> None:
    """Blocks deep in a long prompt cost more to recompute (attention): PGDSF keeps them."""
    deep = make_chain(0, 6)  # blocks 4-5 sit after 16-20 tokens of prefix
    scans = [make_chain(1000 + 100 * i, 1) for i in range(12)]
    saved: dict[str, int] = {}
    for policy in ("lru", "pgdsf"):
        # a steep profile, so the depth effect shows at this test's 4-token blocks
        model = PrefillCostModel([(0, 0.0), (8, 0.1), (24, 2.0)])
        with TieredBlockStore(8 * SIZE, 0, None, policy=policy, cost_model=model) as s:
            deep.put_all(s)
            hits = 0
            for i, scan in enumerate(scans):
                scan.put(s, 0)
                scan.put(s, 0)  # used twice while hot
                if i % 4 == 3:  # the long prompt comes back now and then
                    run = len(s.lookup(deep.keys))  # a load needs the leading run
                    hits += sum(deep.get(s, j) is not None for j in range(run))
                    deep.put_all(s)  # recomputed blocks are written back
                s._check_invariants()
            saved[policy] = hits
    assert saved == {"lru": 12, "pgdsf": 18}, saved  # PGDSF keeps all 6 blocks


def test_restart_drops_a_header_whose_key_does_not_hash_its_prefix(tier_dir: Path) -> None:
    s, chain = disk_store(tier_dir, blocks=2)
    s.close()
    # a well-formed file (valid checksums) that claims block 1's key with other tokens
    disk_tier.write_block(
        tier_dir.resolve(), chain.keys[1], chain.keys[0], [7, 7, 7, 7], BLOCK, b"x" * SIZE
    )
    with TieredBlockStore(0, 4 * SIZE, tier_dir) as s2:
        assert s2.stats().corrupt_drops == 1
        assert s2.lookup(chain.keys) == [Tier.DISK]


@pytest.mark.parametrize("policy", ["lru", "pgdsf"])
def test_heap_victims_equal_the_policy_scan(policy: str) -> None:
    """The lazy leaf heap picks exactly what ``policy.victim`` picks over the evictable leaves."""
    rng = random.Random(7)
    trunk = list(range(9000, 9000 + 2 * BLOCK))
    chains = [
        Chain(trunk[: rng.randrange(3) * BLOCK] + list(range(300 * c, 300 * c + 16)))
        for c in range(8)
    ]
    with TieredBlockStore(5 * SIZE, 0, None, policy=policy) as s:
        checked = 0
        for _ in range(300):
            chain = rng.choice(chains)
            i = rng.randrange(len(chain.keys))
            if rng.random() < 0.4:
                chain.get(s, i)
                continue
            members = set(s._members[Tier.RAM])
            parent = chain.parent(i)
            leaves = [k for k in members if k not in s._children[Tier.RAM] and k != parent]
            must_evict = chain.keys[i] not in s._entries and len(members) == 5
            expected = s._policies[Tier.RAM].victim(leaves) if must_evict and leaves else None
            chain.put(s, i)
            if expected is not None:
                assert set(s._members[Tier.RAM]) == (members - {expected}) | {chain.keys[i]}
                checked += 1
            s._check_invariants()
        assert checked > 50
