"""TierEventLog + ReportingStore: tier membership changes of learned blocks, as net changes per
take (stores before removals), on a real store with evictions in both tiers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from craft_rag.kvtiers.keys import BlockKey, chain_keys
from craft_rag.kvtiers.tier_events import ReportingStore, TierChange, TierEventLog

BLOCK = 4
SIZE = 100


Block = tuple[BlockKey, BlockKey | None, list[int], bytes]


def make_blocks(start: int, n: int) -> list[Block]:
    tokens = list(range(start, start + n * BLOCK))
    keys = chain_keys(tokens, BLOCK, None)
    return [
        (k, keys[i - 1] if i else None, tokens[i * BLOCK : (i + 1) * BLOCK], bytes([i + 1]) * SIZE)
        for i, k in enumerate(keys)
    ]


def vhash(key: BlockKey) -> str:
    return "v" + key.hex()[:6]  # stands for vLLM's hash of the same block


@pytest.fixture
def log() -> TierEventLog:
    return TierEventLog()


@pytest.fixture
def store(tmp_path: Path, log: TierEventLog) -> Iterator[ReportingStore]:
    with ReportingStore(2 * SIZE, 2 * SIZE, tmp_path / "t", policy="lru", events=log) as s:
        yield s


def put(store: ReportingStore, log: TierEventLog, block: Block, prefix: int = 0) -> bool:
    key, parent, tokens, payload = block
    log.learn(key, vhash(key))
    return store.put(key, parent, tokens, payload, prefix)


def summary(changes: list[TierChange]) -> list[tuple[str, str, bool]]:
    return [(c.block_hash, c.tier.value, c.stored) for c in changes]


def test_puts_evictions_and_copy_downs_are_reported_as_net_changes(
    store: ReportingStore, log: TierEventLog
) -> None:
    a = make_blocks(0, 3)
    for i, block in enumerate(a[:2]):
        put(store, log, block, i * BLOCK)
    first = log.take(store.describe)
    assert summary(first) == [(vhash(a[0][0]), "ram", True), (vhash(a[1][0]), "ram", True)]
    assert first[1].parent_hash == vhash(a[0][0]) and first[1].token_ids == tuple(a[1][2])
    assert log.take(store.describe) == []  # nothing changed since
    put(store, log, a[2], 2 * BLOCK)  # RAM full and a[1] is its parent: straight to disk
    assert summary(log.take(store.describe)) == [(vhash(a[2][0]), "disk", True)]
    z = make_blocks(500, 1)[0]
    put(store, log, z)  # RAM full: its LRU leaf a[1] leaves RAM, copied down to disk
    changes = summary(log.take(store.describe))
    assert set(changes[:2]) == {(vhash(a[1][0]), "disk", True), (vhash(z[0]), "ram", True)}
    assert changes[2:] == [(vhash(a[1][0]), "ram", False)]  # stores first: never in no tier
    log._check_invariants()
    store._check_invariants()


def test_a_block_leaving_every_tier_is_removed_and_forgotten(
    tmp_path: Path, log: TierEventLog
) -> None:
    with ReportingStore(0, 2 * SIZE, tmp_path / "d", policy="lru", events=log) as store:
        a, b = make_blocks(0, 1)[0], make_blocks(100, 2)
        put(store, log, a)
        assert summary(log.take(store.describe)) == [(vhash(a[0]), "disk", True)]
        put(store, log, b[0])
        put(store, log, b[1], BLOCK)  # the disk tier holds 2: a (the LRU leaf) goes
        changes = summary(log.take(store.describe))
        assert changes == [
            (vhash(b[0][0]), "disk", True), (vhash(b[1][0]), "disk", True),
            (vhash(a[0]), "disk", False),
        ]
        assert len(log) == 2  # a is forgotten
        log._check_invariants()


def test_unlearned_and_refused_blocks_are_never_reported(
    store: ReportingStore, log: TierEventLog
) -> None:
    a = make_blocks(0, 1)[0]
    store.put(a[0], a[1], a[2], a[3], 0)  # stored, but nothing names it for vLLM
    assert log.take(store.describe) == [] and len(log) == 0
    big = make_blocks(50, 1)[0]
    log.learn(big[0], vhash(big[0]))
    assert not store.put(big[0], None, big[2], b"x" * (3 * SIZE), 0)  # fits no tier
    assert log.take(store.describe) == [] and len(log) == 0
    log.learn(a[0], vhash(a[0]))  # learned later (a hit): reported where it is now
    assert summary(log.take(store.describe)) == [(vhash(a[0]), "ram", True)]


def test_stored_and_dropped_within_one_take_reports_nothing(tmp_path: Path) -> None:
    log = TierEventLog()
    with ReportingStore(0, SIZE, tmp_path / "d", policy="lru", events=log) as store:
        a, b = make_blocks(0, 1)[0], make_blocks(100, 1)[0]
        put(store, log, a)
        put(store, log, b)  # evicts a before anyone took its store
        assert summary(log.take(store.describe)) == [(vhash(b[0]), "disk", True)]
        assert len(log) == 1


def test_a_warm_restart_reports_disk_blocks_once_a_request_names_them(tmp_path: Path) -> None:
    a = make_blocks(0, 2)
    with ReportingStore(0, 4 * SIZE, tmp_path / "d", policy="lru", events=TierEventLog()) as s:
        for i, block in enumerate(a):
            s.put(block[0], block[1], block[2], block[3], i * BLOCK)
    log = TierEventLog()
    with ReportingStore(SIZE, 4 * SIZE, tmp_path / "d", policy="lru", events=log) as store:
        assert log.take(store.describe) == []  # indexed from the headers, not yet named
        log.learn(a[0][0], vhash(a[0][0]))
        assert store.get(a[0][0], a[0][2]) == a[0][3]  # a disk hit, promoted to RAM
        assert summary(log.take(store.describe)) == [
            (vhash(a[0][0]), "disk", True), (vhash(a[0][0]), "ram", True),
        ]
