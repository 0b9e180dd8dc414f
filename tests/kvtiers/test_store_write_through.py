"""TieredBlockStore's write-through: blocks entering RAM are queued for disk at once, so a
store that is never closed cleanly (a crash) leaves them for the next one; the copy-down-once
rule and the disk bound still hold; a full writer queue skips, never blocks."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from test_store import SIZE, files, make_chain
from test_store_machine import StoreMachine

from craft_rag.kvtiers import disk_tier
from craft_rag.kvtiers.store import TieredBlockStore
from craft_rag.kvtiers.tier_types import Tier


def crash(store: TieredBlockStore) -> None:
    """What survives a crash: what the writer wrote. Flushes the queue, then stops the writer
    without the clean close's copy-down (``persist_on_close=False`` stores only)."""
    assert not store._persist_on_close
    store.flush()
    store.close()


@pytest.mark.parametrize("write_through", [True, False])
def test_blocks_in_ram_survive_a_crash_only_with_write_through(
    tmp_path: Path, write_through: bool
) -> None:
    chain = make_chain(0, 3)
    store = TieredBlockStore(
        4 * SIZE, 4 * SIZE, tmp_path, persist_on_close=False, write_through=write_through
    )
    assert chain.put_all(store) == [True, True, True]
    assert store.lookup(chain.keys) == [Tier.RAM] * 3  # RAM wins while in both
    crash(store)
    with TieredBlockStore(4 * SIZE, 4 * SIZE, tmp_path) as again:
        if write_through:
            assert again.lookup(chain.keys) == [Tier.DISK] * 3
            assert [chain.get(again, i) for i in range(3)] == chain.payloads
        else:
            assert again.lookup(chain.keys) == []
    stats = store.stats()
    assert (stats.write_throughs, stats.disk_writes) == ((3, 3) if write_through else (0, 0))


def test_a_written_through_block_is_not_copied_down_again(tmp_path: Path) -> None:
    with TieredBlockStore(2 * SIZE, 8 * SIZE, tmp_path, policy="lru", write_through=True) as s:
        first, second = make_chain(0, 2), make_chain(100, 2)
        first.put_all(s)
        second.put_all(s)  # evicts both of first's blocks from RAM
        s.flush()
        stats = s.stats()
        assert (stats.ram_evictions, stats.copy_downs) == (2, 0)
        assert (stats.write_throughs, stats.disk_writes) == (4, 4)
        assert s.lookup(first.keys) == [Tier.DISK, Tier.DISK]
        assert first.put(s, 0) is False  # already stored: a use, not a second write
        assert [first.get(s, i) for i in range(2)] == first.payloads  # promoted back to RAM
        s.flush()
        assert s.stats().disk_writes == 4
        assert len(files(tmp_path)) == 4
        s._check_invariants(check_files=True)


def test_write_through_keeps_the_disk_bound(tmp_path: Path) -> None:
    with TieredBlockStore(4 * SIZE, 2 * SIZE, tmp_path, policy="lru", write_through=True) as s:
        chain = make_chain(0, 4)
        assert chain.put_all(s) == [True] * 4  # all fit in RAM; the disk keeps 2 leaves' worth
        s.flush()
        stats = s.stats()
        assert stats.ram_entries == 4
        assert stats.disk_bytes <= 2 * SIZE and stats.disk_entries == 2
        assert len(files(tmp_path)) == 2
        s._check_invariants(check_files=True)


def test_a_full_writer_queue_skips_and_never_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = threading.Event(), threading.Event()
    real_write = disk_tier.write_block

    def slow_write(*args: Any, **kwargs: Any) -> None:
        entered.set()
        assert release.wait(30)
        real_write(*args, **kwargs)

    monkeypatch.setattr(disk_tier, "write_block", slow_write)
    chain = make_chain(0, 3)
    store = TieredBlockStore(4 * SIZE, 4 * SIZE, tmp_path, write_through=True, max_queued_writes=1)
    try:
        chain.put(store, 0)
        assert entered.wait(30)  # the writer holds block 0; the queue is empty
        chain.put(store, 1)  # queued: one job
        chain.put(store, 2)  # the queue is full: stays RAM-only, put returns at once
        stats = store.stats()
        assert (stats.write_throughs, stats.write_through_skips) == (2, 1)
        assert store.lookup(chain.keys) == [Tier.RAM] * 3
        store._check_invariants()
    finally:
        release.set()
        store.close()  # the clean close copies the skipped block down
    assert len(files(tmp_path)) == 3
    with TieredBlockStore(4 * SIZE, 4 * SIZE, tmp_path) as again:
        assert again.lookup(chain.keys) == [Tier.DISK] * 3


def test_bad_queue_bound_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_queued_writes"):
        TieredBlockStore(SIZE, SIZE, tmp_path, max_queued_writes=0)


class WriteThroughMachine(StoreMachine):
    write_through = True


TestWriteThroughMachine = WriteThroughMachine.TestCase
TestWriteThroughMachine.settings = StoreMachine.TestCase.settings
