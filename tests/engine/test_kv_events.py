"""Block hashing and KV-event plumbing without an engine (the real-engine proof is in
test_vllm_engine.py)."""

from __future__ import annotations

import hashlib
import pickle
import time
from collections.abc import Iterable
from pathlib import Path

import msgpack
import pytest

from craft_rag.engine.kv_events import (
    AllCleared,
    BlockHasher,
    BlocksRemoved,
    BlocksStored,
    KVEventSync,
    decode_event_batch,
)
from craft_rag.tree import KVLocation
from craft_rag.types import BlockHash, as_block_hash


def test_chained_hashes_follow_vllms_recipe() -> None:
    hasher = BlockHasher.for_algo(4, int_hashes=False, seed="vllm-none-hash")
    none_hash = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    assert hasher.none_hash == none_hash
    tokens = list(range(10))
    h0 = hashlib.sha256(pickle.dumps((none_hash, (0, 1, 2, 3), None), protocol=5)).digest()
    h1 = hashlib.sha256(pickle.dumps((h0, (4, 5, 6, 7), None), protocol=5)).digest()
    assert hasher.raw_hashes(tokens) == [h0, h1]  # the partial block 8-9 has no hash
    assert hasher.block_hashes(tokens) == [BlockHash(h0), BlockHash(h1)]
    salted = hasher.raw_hashes(tokens, cache_salt="tenant")
    assert salted[0] != h0
    assert salted[0] == hashlib.sha256(
        pickle.dumps((none_hash, (0, 1, 2, 3), (("cache_salt", "tenant"),)), protocol=5)
    ).digest()


def test_int_hashes_are_the_low_64_bits_like_vllm_events() -> None:
    hasher = BlockHasher.for_algo(4, int_hashes=True)
    raw = hasher.raw_hashes([1, 2, 3, 4])[0]
    expected = int.from_bytes(raw, "big") & ((1 << 64) - 1)
    assert hasher.block_hashes([1, 2, 3, 4]) == [as_block_hash(expected)]


def test_pythonhashseed_changes_the_none_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    default = BlockHasher.for_algo(4).none_hash
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert BlockHasher.for_algo(4).none_hash != default


def test_blocks_belong_to_the_chunk_their_last_token_is_in() -> None:
    hasher = BlockHasher.for_algo(4)
    hashes = [BlockHash(bytes([i])) for i in range(6)]  # blocks end at 3, 7, 11, 15, 19, 23
    spans = [(2, 9), (9, 10), (10, 24)]
    assert hasher.per_chunk(hashes, spans) == [
        [hashes[0], hashes[1]],  # blocks ending at tokens 3 and 7
        [],  # no block ends inside a 1-token chunk at 9
        [hashes[2], hashes[3], hashes[4], hashes[5]],
    ]


def _payload(events: list[dict[str, object]]) -> bytes:
    packed: bytes = msgpack.packb([time.time(), events, 0])
    return packed


def test_decode_event_batch_reads_vllms_wire_format() -> None:
    payload = _payload(
        [
            {
                "type": "BlockStored",
                "block_hashes": [b"\x01" * 32, 12345],
                "parent_block_hash": None,
                "token_ids": list(range(64)),
                "block_size": 32,
                "lora_id": None,
                "medium": "GPU",
            },
            {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
            {"type": "SomethingNew", "x": 1},
        ]
    )
    events = decode_event_batch(payload)
    assert events == [
        BlocksStored(
            hashes=(BlockHash(b"\x01" * 32), as_block_hash(12345)),
            parent=None,
            token_ids=tuple(range(64)),
            block_size=32,
            medium="GPU",
        ),
        BlocksRemoved((BlockHash(b"\x01" * 32),), medium="GPU"),
        AllCleared(),
    ]
    with pytest.raises(ValueError, match="KV event"):
        decode_event_batch(b"\xc1not msgpack")


class RecordingListener:
    def __init__(self) -> None:
        self.removed: list[BlockHash] = []
        self.clears = 0

    def on_blocks_removed(self, hashes: Iterable[BlockHash]) -> int:
        hashes = list(hashes)
        self.removed.extend(hashes)
        return len(hashes)

    def on_blocks_moved(self, hashes: Iterable[BlockHash], location: KVLocation) -> int:
        return 0  # no tier events here

    def on_all_blocks_cleared(self) -> None:
        self.clears += 1


def test_sync_forwards_evictions_and_counts_gaps(tmp_path: Path) -> None:
    zmq = pytest.importorskip("zmq")
    endpoint = f"ipc://{tmp_path}/events.sock"
    listener = RecordingListener()
    sync = KVEventSync(endpoint, listener)  # connects before the publisher binds
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    try:
        # PUB drops messages until the subscription arrives: probe until one gets through.
        deadline = time.monotonic() + 10
        while sync.stats.batches == 0 and time.monotonic() < deadline:
            pub.send_multipart((b"", (0).to_bytes(8, "big"), _payload([])))
            time.sleep(0.05)
        assert sync.stats.batches >= 1
        probes = sync.stats.batches
        batches = [
            [{"type": "BlockStored", "block_hashes": [b"a"], "parent_block_hash": None,
              "token_ids": [1], "block_size": 1}],
            [{"type": "BlockRemoved", "block_hashes": [b"a", b"b"]}],
            [{"type": "AllBlocksCleared"}],
        ]
        for seq, batch in zip((1, 2, 6), batches, strict=True):
            pub.send_multipart((b"", seq.to_bytes(8, "big"), _payload(batch)))
        assert sync.wait_for(lambda events: any(isinstance(e, AllCleared) for e in events))
        assert listener.removed == [BlockHash(b"a"), BlockHash(b"b")]
        assert listener.clears == 2  # the gap 2 -> 6 resyncs by clearing, then AllBlocksCleared
        stats = sync.stats
        assert (stats.batches - probes, stats.blocks_stored, stats.blocks_removed) == (3, 1, 2)
        assert stats.nodes_removed == 2 and stats.gaps == 1 and stats.last_seq == 6
        assert sync.wait_through(6, timeout=0.1)
        assert not sync.wait_through(7, timeout=0.05) and stats.barrier_timeouts == 1

        pub.send_multipart((b"", (7).to_bytes(8, "big"), b"\xc1garbage"))
        pub.send_multipart((b"only-one-frame",))
        deadline = time.monotonic() + 5
        while sync.stats.undecodable < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sync.stats.undecodable == 2
        assert sync.stats.last_seq == 7  # an undecodable batch still advances the barrier
    finally:
        sync.close()
        pub.close(linger=0)
        ctx.term()
    sync.close()  # idempotent


def test_an_expected_clear_is_not_forwarded_and_a_gap_forgets_it(tmp_path: Path) -> None:
    """Our own reset's AllBlocksCleared comes with vLLM's next step, possibly after a commit
    made since: the engine announced it (expect_clear) and already cleared, so it must not
    clear the listener again. An unexpected one (another client's reset) still does."""
    zmq = pytest.importorskip("zmq")
    endpoint = f"ipc://{tmp_path}/events.sock"
    listener = RecordingListener()
    sync = KVEventSync(endpoint, listener)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    cleared = [{"type": "AllBlocksCleared"}]

    def send(seq: int, batch: list[dict[str, object]]) -> None:
        pub.send_multipart((b"", seq.to_bytes(8, "big"), _payload(batch)))
        assert sync.wait_through(seq, timeout=10)

    try:
        deadline = time.monotonic() + 10
        while sync.stats.batches == 0 and time.monotonic() < deadline:
            pub.send_multipart((b"", (0).to_bytes(8, "big"), _payload([])))
            time.sleep(0.05)
        assert sync.stats.last_seq == 0
        sync.expect_clear()
        send(1, cleared)  # ours: counted, not forwarded
        assert (listener.clears, sync.stats.clears, sync.stats.own_clears) == (0, 1, 1)
        send(2, cleared)  # nobody expected this one
        assert (listener.clears, sync.stats.own_clears) == (1, 1)
        sync.expect_clear()
        sync.cancel_clear()  # the reset failed: no event will come
        send(3, cleared)
        assert listener.clears == 2
        sync.expect_clear()
        send(5, [])  # a gap: the lost batch may have held our event; forget it, resync
        assert listener.clears == 3 and sync.stats.gaps == 1
        send(6, cleared)
        assert listener.clears == 4 and sync.stats.own_clears == 1
    finally:
        sync.close()
        pub.close(linger=0)
        ctx.term()
