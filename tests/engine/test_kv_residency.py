"""TierResidency (a pool removal of a block a KV tier still holds does not reach the CP-Tree),
the wire's ``medium`` field, and KVEventSync applying both, with fake events (no engine)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from pathlib import Path

import msgpack
import pytest

from craft_rag.engine.kv_event_wire import MalformedBatch, decode_batch
from craft_rag.engine.kv_events import BlocksRemoved, BlocksStored, KVEventSync
from craft_rag.engine.kv_residency import TierResidency
from craft_rag.tree import KVLocation
from craft_rag.types import BlockHash

A, B, C = BlockHash(b"a" * 32), BlockHash(b"b" * 32), BlockHash(b"c" * 32)


def test_a_pool_removal_is_held_while_a_tier_holds_the_block() -> None:
    r = TierResidency()
    r.stored([A], "GPU")  # untracked: the pool alone is not tracked
    assert len(r) == 0
    r.stored([A], "CPU")
    assert r.media(A) == {"GPU", "CPU"}  # a tier's first report: in the pool too
    assert r.removed([A], "GPU") == [] and r.held == 1
    assert r.media(A) == {"CPU"}
    r.stored([A], "STORAGE")  # copy-down reported before the RAM removal
    assert r.removed([A], "CPU") == []
    assert r.removed([A], "STORAGE") == [A]  # in no medium now: the CP-Tree may drop it
    assert len(r) == 0
    r._check_invariants()


def test_a_tier_removal_of_a_block_still_in_the_pool_waits_for_the_pools() -> None:
    r = TierResidency()
    r.stored([A, B], "CPU")
    assert r.removed([A], "CPU") == []  # the pool still holds it
    assert r.removed([A], "GPU") == [A]  # untracked again: passes like without tiers
    assert r.removed([C], "GPU") == [C]
    assert r.removed([C], "STORAGE") == []  # a tier removal of an unknown block: nothing
    assert r.removed([B], None) == [] and r.media(B) == {"CPU"}  # None is the pool
    r._check_invariants()


def test_a_pool_clear_keeps_tier_bits_and_a_full_clear_forgets() -> None:
    r = TierResidency()
    r.stored([A, B], "CPU")
    r.pool_cleared()
    assert r.media(A) == {"CPU"}
    assert r.removed([A], "CPU") == [A]  # the pool was cleared: gone everywhere
    r.stored([B], "GPU")  # loaded back into the pool
    assert r.removed([B], "CPU") == []
    r.stored([C], "STORAGE")
    r.clear()
    assert len(r) == 0 and r.removed([C], "GPU") == [C]


def test_past_the_bound_the_oldest_is_forgotten_on_the_safe_side() -> None:
    r = TierResidency(max_tracked=2)
    r.stored([A, B, C], "CPU")
    assert len(r) == 2 and r.media(A) == frozenset()
    assert r.removed([A], "GPU") == [A]  # forgotten: its pool removal passes through
    assert r.removed([B], "GPU") == []
    with pytest.raises(ValueError, match="max_tracked"):
        TierResidency(max_tracked=0)


def test_random_events_match_a_per_medium_model() -> None:
    """Seeded stress against a plain model: a hash passes exactly when it leaves its last
    medium (the pool assumed to hold a block a tier reports first), invariants every step."""
    rng = random.Random(27)
    hashes = [BlockHash(bytes([i]) * 32) for i in range(6)]
    for _ in range(30):
        r = TierResidency(max_tracked=1000)
        model: dict[BlockHash, set[str]] = {}
        for _ in range(200):
            h, medium = rng.choice(hashes), rng.choice(["GPU", "CPU", "STORAGE"])
            if rng.random() < 0.5:
                r.stored([h], medium)
                media = model.get(h)
                if media is not None:
                    media.add(medium)
                elif medium != "GPU":
                    model[h] = {medium, "GPU"}
            else:
                gone = r.removed([h], medium)
                media = model.get(h)
                if media is None:
                    assert gone == ([h] if medium == "GPU" else [])
                else:
                    media.discard(medium)
                    if not media - {"GPU"}:
                        del model[h]
                        assert gone == ([] if "GPU" in media else [h])
                    else:
                        assert gone == []
            r._check_invariants()
            assert {h: set(r.media(h)) for h in hashes if r.media(h)} == model


def _batch(*events: dict[str, object]) -> bytes:
    packed: bytes = msgpack.packb([1.0, list(events), 0])
    return packed


def _stored(h: bytes, medium: object) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None,
            "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": medium}


def test_the_wire_reads_medium_and_refuses_unknown_ones() -> None:
    events = decode_batch(_batch(
        _stored(b"a", "CPU"), _stored(b"b", None), _stored(b"c", "storage"),
        {"type": "BlockRemoved", "block_hashes": [b"a"], "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [b"a"]},
    )).events
    assert [e.medium for e in events] == ["CPU", None, "STORAGE", "GPU", None]  # type: ignore[union-attr]
    for bad in ("NVME", "", 3, ["CPU"], "C" * 100):
        with pytest.raises(MalformedBatch, match="'medium' must be one of"):
            decode_batch(_batch(_stored(b"a", bad)))
        with pytest.raises(MalformedBatch, match="'medium'"):
            decode_batch(_batch({"type": "BlockRemoved", "block_hashes": [b"a"], "medium": bad}))


class _Listener:
    def __init__(self) -> None:
        self.removed: list[BlockHash] = []
        self.moved: dict[BlockHash, str] = {}  # hash -> its latest location's tier

    def on_blocks_moved(self, hashes: Iterable[BlockHash], location: KVLocation) -> int:
        hashes = list(hashes)
        self.moved.update(dict.fromkeys(hashes, location.tier))
        return len(hashes)

    def on_blocks_removed(self, hashes: Iterable[BlockHash]) -> int:
        hashes = list(hashes)
        self.removed.extend(hashes)
        return len(hashes)

    def on_all_blocks_cleared(self) -> None:
        self.removed.append(BlockHash(b"CLEAR"))


def test_the_sync_forwards_a_removal_only_once_no_medium_holds_the_block(
    tmp_path: Path,
) -> None:
    zmq = pytest.importorskip("zmq")
    endpoint = f"ipc://{tmp_path}/events.sock"
    listener = _Listener()
    sync = KVEventSync(endpoint, listener)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)

    def send(seq: int, *events: dict[str, object]) -> None:
        pub.send_multipart((b"", seq.to_bytes(8, "big"), _batch(*events)))
        assert sync.wait_through(seq, timeout=10)

    def gone(h: bytes, medium: str) -> dict[str, object]:
        return {"type": "BlockRemoved", "block_hashes": [h], "medium": medium}

    try:
        deadline = time.monotonic() + 10
        while sync.stats.batches == 0 and time.monotonic() < deadline:
            pub.send_multipart((b"", (0).to_bytes(8, "big"), _batch()))
            time.sleep(0.05)
        assert sync.stats.last_seq == 0
        send(1, _stored(b"a", "GPU"), _stored(b"b", "GPU"), _stored(b"a", "CPU"))
        send(2, gone(b"a", "GPU"), gone(b"b", "GPU"))  # a is in the RAM tier: held
        assert listener.removed == [BlockHash(b"b")] and sync.residency.held == 1
        assert listener.moved == {b"a": "CPU"} and sync.stats.nodes_moved == 1  # RAM only now
        send(3, _stored(b"a", "STORAGE"), gone(b"a", "CPU"))  # copied down, still held
        assert listener.removed == [BlockHash(b"b")] and listener.moved == {b"a": "STORAGE"}
        send(4, gone(b"a", "STORAGE"))
        assert listener.removed == [BlockHash(b"b"), BlockHash(b"a")]
        assert sync.stats.blocks_removed == 4 and sync.stats.nodes_removed == 2
        send(5, _stored(b"c", "CPU"))
        send(7)  # a gap: nothing known is trusted, residency forgotten with the tree
        assert len(sync.residency) == 0 and listener.removed[-1] == b"CLEAR"
        assert all(isinstance(e, BlocksStored | BlocksRemoved) for e in sync.recent_events())
        assert {e.medium for e in sync.recent_events()} == {"GPU", "CPU", "STORAGE"}  # type: ignore[union-attr]
    finally:
        sync.close()
        pub.close(linger=0)
        ctx.term()


def _cheapest(media: set[str]) -> str:
    return next(m for m in ("GPU", "CPU", "STORAGE") if m in media)


def test_moves_report_each_change_of_the_cheapest_medium() -> None:
    """What the router's cost reads: pool, else RAM, else disk; a first tier report is no move
    (the block is in the pool too); the pool taking a block back moves it to the pool."""
    r, heard = TierResidency(), _Listener()

    def flush() -> dict[BlockHash, str]:
        heard.moved.clear()
        r.flush_moves(heard)
        return dict(heard.moved)

    r.stored([A, B], "CPU")
    assert flush() == {}
    r.removed([A, B], "GPU")
    assert flush() == {A: "CPU", B: "CPU"}
    r.stored([A], "STORAGE")  # RAM is still cheaper
    assert flush() == {}
    r.removed([A], "CPU")
    r.stored([B], "GPU")  # loaded back into the pool
    assert flush() == {A: "STORAGE", B: "device"}  # device: the pool, as commits set it
    r.removed([B], "GPU")
    r.pool_cleared()  # the clear empties the CP-Tree: queued moves are dropped
    assert flush() == {}
    r.removed([A], "GPU")
    r.clear()
    assert flush() == {} and r.flush_moves(None) == 0


def test_a_listener_without_the_move_hook_keeps_working() -> None:
    """A listener written before tiers (no ``on_blocks_moved``) is not told of moves; its
    removals still arrive."""

    class OldListener:
        def __init__(self) -> None:
            self.removed: list[BlockHash] = []

        def on_blocks_removed(self, hashes: Iterable[BlockHash]) -> int:
            self.removed.extend(hashes)
            return 0

        def on_all_blocks_cleared(self) -> None:
            pass

    r, old = TierResidency(), OldListener()
    r.stored([A], "CPU")
    r.removed([A], "GPU")  # a move to RAM is queued
    assert r.flush_moves(old) == 0  # type: ignore[arg-type]  # no hook: nothing to call
    assert r.removed([A], "CPU") == [A]  # gone from every medium: a removal, as before


def test_random_moves_track_the_cheapest_medium() -> None:
    """Seeded stress: after every event the last location heard for each tracked hash (the
    pool if never moved) is its cheapest medium in a plain per-medium model."""
    rng = random.Random(31)
    hashes = [BlockHash(bytes([i]) * 32) for i in range(6)]
    for _ in range(30):
        r, heard = TierResidency(max_tracked=1000), _Listener()
        model: dict[BlockHash, set[str]] = {}
        for _ in range(200):
            h, medium = rng.choice(hashes), rng.choice(["GPU", "CPU", "STORAGE"])
            if rng.random() < 0.5:
                r.stored([h], medium)
                if h in model:
                    model[h].add(medium)
                elif medium != "GPU":
                    model[h] = {medium, "GPU"}
                    heard.moved.pop(h, None)  # a new entry: its node was committed in the pool
            else:
                r.removed([h], medium)
                if h in model:
                    model[h].discard(medium)
                    if not model[h] - {"GPU"}:
                        del model[h]
            r.flush_moves(heard)
            r._check_invariants()
            for tracked, media in model.items():
                assert heard.moved.get(tracked, "device") == {"GPU": "device"}.get(
                    _cheapest(media), _cheapest(media))


def test_moves_relocate_the_planners_nodes() -> None:
    from craft_rag.chunk import make_chunk
    from craft_rag.planner import CraftPlanner

    planner = CraftPlanner()
    plan = planner.plan([make_chunk("x", id="x", num_tokens=64)])
    planner.commit(plan, prefix_tokens=0, block_hashes=[[A]])
    r = TierResidency()
    r.stored([A], "STORAGE")
    r.removed([A], "GPU")
    assert r.flush_moves(planner) == 1
    node = planner.prefix_tree.match([plan.ordered[0].key]).nodes[-1]
    assert node.location == KVLocation(tier="STORAGE")
