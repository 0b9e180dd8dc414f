"""A hostile or broken KV event publisher, over a real ZMQ PUB socket: malformed batches are
counted, logged once, resynced and survived; over-size messages and the recent-events log stay
within their bounds."""

from __future__ import annotations

import gc
import logging
import time
import tracemalloc
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from test_kv_events import RecordingListener

from craft_rag.engine.kv_events import (
    MAX_MESSAGE_BYTES,
    RECENT_EVENTS,
    RECENT_HASHES,
    BlocksRemoved,
    BlocksStored,
    KVEventSync,
    MalformedBatch,
    decode_event_batch,
)
from craft_rag.types import BlockHash, as_block_hash

zmq = pytest.importorskip("zmq")

Frames = list[bytes]


class Clock:
    """Monotonic time plus a jump the test controls (for the warning rate limit)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


class Hub:
    def __init__(self, tmp_path: Path, **kwargs: Any) -> None:
        self.endpoint = f"ipc://{tmp_path}/events.sock"
        self.listener = RecordingListener()
        self.clock = Clock()
        self.sync = KVEventSync(self.endpoint, self.listener, clock=self.clock, **kwargs)
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.bind(self.endpoint)
        # PUB drops messages until the subscription arrives: probe until one gets through.
        deadline = time.monotonic() + 30  # generous: CI machines are shared
        while self.sync.stats.batches == 0 and time.monotonic() < deadline:
            self.send(0, [])
            time.sleep(0.05)
        assert self.sync.stats.last_seq == 0

    def send(self, seq: int, events: list[Any], topic: bytes = b"") -> None:
        self.pub.send_multipart([topic, seq.to_bytes(8, "big"), payload(events)])

    def until(self, what: Callable[[], bool], timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while not what():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        self.sync.close()
        self.pub.close(linger=0)
        self.ctx.term()


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[Hub]:
    made = Hub(tmp_path)
    yield made
    made.close()


def payload(events: list[Any], ts: object = 1.5) -> bytes:
    packed: bytes = msgpack.packb([ts, events, 0])
    return packed


def stored(**fields: Any) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "BlockStored", "block_hashes": [b"h1", 7], "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU",
    }
    event.update(fields)
    return event


def removed(*hashes: bytes | int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


SEQ2 = (2).to_bytes(8, "big")


def one(payload_bytes: bytes) -> Frames:
    return [b"", SEQ2, payload_bytes]


def nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\x00"  # [[[...[0]...]]]


# Malformed messages whose sequence number is readable (2): the batch is lost at a known place.
WITH_SEQ: dict[str, Frames] = {
    "stored block_hashes int": one(payload([stored(block_hashes=5)])),
    "removed block_hashes int": one(payload([removed(), {"type": "BlockRemoved",
                                                         "block_hashes": 5}])),
    "stored token_ids int": one(payload([stored(token_ids=5)])),
    "stored block_size list": one(payload([stored(block_size=[1])])),
    "stored block_size str": one(payload([stored(block_size="32")])),
    "stored block_size zero": one(payload([stored(block_size=0)])),
    "stored block_size negative": one(payload([stored(block_size=-1)])),
    "stored block_size bool": one(payload([stored(block_size=True)])),
    "stored block_size huge": one(payload([stored(block_size=2**63)])),
    "stored block_size float": one(payload([stored(block_size=32.0)])),
    "stored block_size nil": one(payload([stored(block_size=None)])),
    "stored token_ids strings": one(payload([stored(token_ids=[1, "2"])])),
    "stored token_ids negative": one(payload([stored(token_ids=[1, -2])])),
    "stored token_ids huge": one(payload([stored(token_ids=[2**64 - 1])])),
    "stored token_ids floats": one(payload([stored(token_ids=[1.5])])),
    "stored token_ids nested": one(payload([stored(token_ids=[[1]])])),
    "stored token_ids map": one(payload([stored(token_ids={"a": 1})])),
    "stored missing token_ids": one(payload([{k: v for k, v in stored().items()
                                              if k != "token_ids"}])),
    "stored missing block_size": one(payload([{k: v for k, v in stored().items()
                                               if k != "block_size"}])),
    "missing block_hashes": one(payload([{"type": "BlockRemoved"}])),
    "block hash str": one(payload([removed("abc")])),  # type: ignore[arg-type]
    "block hash float": one(payload([{"type": "BlockRemoved", "block_hashes": [1.5]}])),
    "block hash nil": one(payload([{"type": "BlockRemoved", "block_hashes": [None]}])),
    "block hash bool": one(payload([{"type": "BlockRemoved", "block_hashes": [True]}])),
    "block hash empty bytes": one(payload([removed(b"")])),
    "block hash 100 bytes": one(payload([removed(b"x" * 100)])),
    "block hash nested": one(payload([{"type": "BlockRemoved", "block_hashes": [[1, 2]]}])),
    "parent str": one(payload([stored(parent_block_hash="p")])),
    "parent list": one(payload([stored(parent_block_hash=[1])])),
    "extra_keys int": one(payload([stored(extra_keys=5)])),
    "extra_keys str": one(payload([stored(extra_keys="salt")])),
    "extra_keys entry str": one(payload([stored(extra_keys=["salt", None])])),
    "extra_keys entry huge": one(payload([stored(extra_keys=[list(range(1000))])])),
    "event int": one(payload([5])),
    "event list": one(payload([["BlockRemoved", [1]]])),
    "event nil": one(payload([None])),
    "type missing": one(payload([{"block_hashes": [1]}])),
    "type int": one(payload([{"type": 5, "block_hashes": [1]}])),
    "type nil": one(payload([{"type": None}])),
    "bad event after good one": one(payload([removed(b"x"), stored(token_ids=5)])),
    "events int": one(msgpack.packb([1.5, 5, 0])),
    "events map": one(msgpack.packb([1.5, {"a": 1}, 0])),
    "batch map": one(msgpack.packb({"ts": 1.5, "events": []})),
    "batch empty": one(msgpack.packb([])),
    "batch one item": one(msgpack.packb([1.5])),
    "batch int": one(msgpack.packb(5)),
    "ts str": one(msgpack.packb(["now", [], 0])),
    "dp_rank str": one(msgpack.packb([1.5, [], "0"])),
    "truncated msgpack": one(payload([stored()])[:-3]),
    "invalid byte": one(b"\xc1garbage"),
    "empty payload": one(b""),
    "trailing bytes": one(payload([]) + b"\x00"),
    "nested 100000 deep": one(b"\x93\xcb" + b"\x00" * 8 + b"\x91" + nested(100_000) + b"\x00"),
    "event nested garbage": one(b"\x93\xcb" + b"\x00" * 8 + b"\x91" + nested(500) + b"\x00"),
    "huge map": one(msgpack.packb([1.5, [{str(i): i for i in range(5000)}], 0])),
}

# Malformed messages without a readable sequence number.
NO_SEQ: dict[str, Frames] = {
    "one part": [b"only-one-frame"],
    "two parts": [b"", SEQ2],
    "four parts": [b"", SEQ2, payload([]), b"extra"],
    "hundred parts": [b""] * 100,
    "seq 0 bytes": [b"", b"", payload([])],
    "seq 7 bytes": [b"", b"\x00" * 6 + b"\x02", payload([])],
    "seq 9 bytes": [b"", b"\x00" * 8 + b"\x02", payload([])],
    "seq huge int": [b"", b"\x7f" * 100, payload([])],
    "seq negative": [b"", b"\xff" * 8, payload([])],
}


@pytest.mark.parametrize("case", sorted(WITH_SEQ) + sorted(NO_SEQ))
def test_a_malformed_batch_is_lost_resynced_and_the_subscriber_keeps_applying(
    hub: Hub, case: str
) -> None:
    hub.send(1, [stored()])
    assert hub.sync.wait_through(1, timeout=30)
    hub.pub.send_multipart(WITH_SEQ.get(case) or NO_SEQ[case])
    assert hub.until(lambda: hub.sync.stats.undecodable == 1), "the batch was not counted"
    assert hub.listener.clears == 1  # resynced: the lost batch may have held evictions
    hub.send(3, [removed(b"gone")])
    gone = BlockHash(b"gone")
    assert hub.sync.wait_for(
        lambda evs: any(isinstance(e, BlocksRemoved) and gone in e.hashes for e in evs),
        timeout=30,
    ), "evictions are no longer applied"
    assert hub.listener.removed == [gone]
    if case in WITH_SEQ:  # the barrier passed the lost batch: 3 follows 2, no second resync
        assert hub.sync.stats.gaps == 0 and hub.listener.clears == 1
    assert hub.sync.stats.batches == 3  # probe, 1 and 3: the lost batch is not "applied"


def test_unknown_event_types_and_fields_are_skipped_not_lost(hub: Hub) -> None:
    newer = msgpack.packb([1.5, [removed(b"n")], 0, {"added": "by a newer vLLM"}])
    hub.pub.send_multipart([b"", (1).to_bytes(8, "big"), newer])  # a longer batch array
    assert hub.sync.wait_through(1, timeout=30) and hub.listener.removed == [BlockHash(b"n")]
    hub.listener.removed.clear()
    events = [
        {"type": "BlockPinned", "block_hashes": 5},
        stored(block_hashes=[b"k"], future_field={"nested": [[[]]]}),
        removed(b"k"),
    ]
    hub.send(2, events)
    assert hub.sync.wait_through(2, timeout=30)
    assert hub.sync.stats.unknown_events == 1 and hub.sync.stats.undecodable == 0
    assert hub.listener.removed == [BlockHash(b"k")] and hub.listener.clears == 0


def test_a_flood_of_malformed_batches_logs_one_warning_per_interval(
    hub: Hub, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="craft_rag.engine.kv_events")
    for seq in range(1, 31):
        hub.pub.send_multipart([b"", seq.to_bytes(8, "big"), b"\xc1<script>"])
    assert hub.until(lambda: hub.sync.stats.undecodable == 30)
    warnings = [r for r in caplog.records if r.name == "craft_rag.engine.kv_events"]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert hub.endpoint in text and "resynced" in text and "<script>" not in text
    assert hub.listener.clears == 30 and hub.sync.stats.last_seq == 30
    hub.clock.offset += 61  # past the interval: the next loss is logged with the count
    hub.pub.send_multipart([b"", (31).to_bytes(8, "big"), b"\xc1"])
    assert hub.until(lambda: hub.sync.stats.undecodable == 31)
    warnings = [r for r in caplog.records if r.name == "craft_rag.engine.kv_events"]
    assert len(warnings) == 2 and "29 more since the last warning" in warnings[1].getMessage()


def test_a_listener_that_raises_is_a_lost_batch_not_a_dead_thread(hub: Hub) -> None:
    calls = {"n": 0}
    real = hub.listener.on_blocks_removed

    def flaky(hashes: Iterable[BlockHash]) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("store down")
        return real(hashes)

    hub.listener.on_blocks_removed = flaky  # type: ignore[method-assign]
    hub.send(1, [removed(b"a")])
    assert hub.until(lambda: hub.sync.stats.listener_errors == 1)
    assert hub.listener.clears == 1
    hub.send(2, [removed(b"b")])
    assert hub.sync.wait_through(2, timeout=30) and hub.listener.removed == [BlockHash(b"b")]


def _probe_until_removed(hub: Hub, first_seq: int, timeout: float = 30.0) -> bool:
    """Send BlockRemoved batches until one is applied (a new socket must resubscribe first)."""
    gone = BlockHash(b"gone")
    deadline = time.monotonic() + timeout
    seq = first_seq
    while time.monotonic() < deadline:
        hub.send(seq, [removed(b"gone")])
        seq += 1
        if hub.sync.wait_for(
            lambda evs: any(isinstance(e, BlocksRemoved) and gone in e.hashes for e in evs),
            timeout=0.05,
        ):
            return True
    return False


def test_an_oversized_batch_is_refused_unread_and_resynced(hub: Hub) -> None:
    """23 MB of token ids (the size that cost +267 MiB and 6.8 s): refused by ZMQ before it is
    read (MAXMSGSIZE), counted, resynced; the sync reconnects and applies the next batches."""
    assert hub.sync.max_message_bytes == MAX_MESSAGE_BYTES
    big = payload([stored(block_hashes=[1], token_ids=list(range(60_000, 60_000 + 7_700_000)))])
    assert len(big) > 23_000_000
    hub.send(1, [stored()])
    assert hub.sync.wait_through(1, timeout=30)
    stored_before = hub.sync.stats.blocks_stored
    gc.collect()
    tracemalloc.start()
    try:
        started = time.monotonic()
        hub.pub.send_multipart([b"", SEQ2, big])
        assert _probe_until_removed(hub, 3), "the sync never recovered from the big batch"
        elapsed = time.monotonic() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    stats = hub.sync.stats
    assert stats.disconnects + stats.oversized >= 1 and hub.listener.clears >= 1
    assert stats.blocks_stored == stored_before  # nothing of it was applied
    assert peak < 8 << 20, f"the subscriber allocated {peak >> 20} MiB for a refused batch"
    assert elapsed < 20  # the unbounded decode took 6.8 s unloaded, far more traced


def test_a_message_over_the_cap_in_total_is_refused_before_decoding(tmp_path: Path) -> None:
    """Each frame under the cap (ZMQ lets it through), the message over it: the sync's own
    check refuses it before decoding."""
    hub = Hub(tmp_path, max_message_bytes=64 << 10)
    try:
        half = payload([removed(*range(10**6, 10**6 + 6000))])  # ~30 KiB, a valid batch
        assert 16 << 10 < len(half) < 64 << 10
        hub.pub.send_multipart([b"t" * (40 << 10), (1).to_bytes(8, "big"), half])
        assert hub.until(lambda: hub.sync.stats.oversized == 1)
        assert hub.listener.removed == [] and hub.listener.clears == 1
        assert hub.sync.stats.last_seq == 1  # lost at a known place: the barrier passes it
        hub.send(2, [removed(b"gone")])
        assert hub.sync.wait_through(2, timeout=30)
        assert hub.listener.removed == [BlockHash(b"gone")]
    finally:
        hub.close()
    with pytest.raises(ValueError, match="max_message_bytes"):
        KVEventSync(f"ipc://{tmp_path}/x.sock", max_message_bytes=10)
    with pytest.raises(ValueError, match="cannot be connected"):
        KVEventSync("no-transport-here")


def test_recent_events_keep_hashes_not_token_ids_in_bounded_memory(hub: Hub) -> None:
    """2,048-token prompts: the recent log keeps 64 hashes per event, not 2,048 token ids
    (which cost +340 MiB at 4,096 events)."""
    hashes = list(range(10**12, 10**12 + 64))
    batch = payload([stored(block_hashes=hashes, token_ids=list(range(1000, 3048)),
                            block_size=32, extra_keys=[["tenant-a"]] + [None] * 63)])
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for seq in range(1, 601):
            hub.pub.send_multipart([b"", seq.to_bytes(8, "big"), batch])
        assert hub.sync.wait_through(600, timeout=120)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    recent = [e for e in hub.sync.recent_events() if isinstance(e, BlocksStored)]
    assert len(recent) == 600 and hub.sync.stats.undecodable == 0
    assert recent[-1].hashes == tuple(as_block_hash(h) for h in hashes)
    assert recent[-1].token_ids == () and recent[-1].extra_keys == (("tenant-a",),)
    assert grown < 8 << 20, f"the recent log grew by {grown >> 20} MiB for 600 events"


def test_recent_events_are_bounded_in_events_and_in_hashes(hub: Hub) -> None:
    many = payload([removed(*range(1000))])
    for seq in range(1, 71):  # 70,000 hashes
        hub.pub.send_multipart([b"", seq.to_bytes(8, "big"), many])
    assert hub.sync.wait_through(70, timeout=60)
    recent = hub.sync.recent_events()
    kept = sum(len(e.hashes) for e in recent if isinstance(e, BlocksRemoved))
    assert RECENT_HASHES - 1000 < kept <= RECENT_HASHES
    assert hub.sync.stats.blocks_removed == 70_000  # all applied, only the log is bounded
    huge = payload([removed(*range(RECENT_HASHES + 5000))])  # one event over the hash bound
    hub.pub.send_multipart([b"", (71).to_bytes(8, "big"), huge])
    assert hub.sync.wait_through(71, timeout=30)
    recent = hub.sync.recent_events()
    assert len(recent) == 1 and len(recent[0].hashes) == RECENT_HASHES  # type: ignore[union-attr]
    cleared = payload([{"type": "AllBlocksCleared"}])
    for seq in range(72, 72 + RECENT_EVENTS + 10):
        hub.pub.send_multipart([b"", seq.to_bytes(8, "big"), cleared])
    assert hub.sync.wait_through(72 + RECENT_EVENTS + 9, timeout=60)
    assert len(hub.sync.recent_events()) == RECENT_EVENTS


def test_decode_names_the_bad_field_and_quotes_no_payload() -> None:
    with pytest.raises(MalformedBatch, match=r"event 1: 'block_size' must be an int"):
        decode_event_batch(payload([removed(b"a"), stored(block_size=[1])]))
    with pytest.raises(ValueError, match=r"'token_ids' must be ints"):
        decode_event_batch(payload([stored(token_ids=[1, "<secret>"])]))
    with pytest.raises(ValueError, match=r"'type' must be a string, got bytes") as info:
        decode_event_batch(payload([{"type": b"x" * 10_000}]))
    assert len(str(info.value)) < 200


def test_a_publisher_restart_resyncs_and_the_new_socket_applies_its_batches(hub: Hub) -> None:
    hub.send(1, [stored()])
    assert hub.sync.wait_through(1, timeout=30)
    hub.pub.close(linger=0)
    assert hub.until(lambda: hub.sync.stats.disconnects >= 1), "the drop went unnoticed"
    assert hub.listener.clears >= 1  # batches may have been lost while it was down
    hub.pub = hub.ctx.socket(zmq.PUB)
    hub.pub.bind(hub.endpoint)
    assert _probe_until_removed(hub, 0), "the sync never heard the new publisher"
    assert hub.sync._thread.is_alive()
