"""Issue 11: bad input against every public core entry point.

Each case asserts the exact exception type, that the message names the field, and that nothing
changed: the planner's invariants hold, its saved state and stats are byte-for-byte the same,
and a refused commit leaves the plan committable.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from craft_rag import validation
from craft_rag.access_table import ChunkAccessTable
from craft_rag.chunk import Chunk, make_chunk
from craft_rag.conversation import ConversationRegistry
from craft_rag.ordering import get_policy
from craft_rag.planner import CraftPlanner, Plan, PlannerConfig
from craft_rag.prefix_cache_sim import SimulatedPrefixCache
from craft_rag.prefix_tree import ChunkPrefixTree, KVLocation, NodeMetadata
from craft_rag.promotion import get_promotion_rule
from craft_rag.routing.policies import get_routing_policy
from craft_rag.testing import FakeClock
from craft_rag.types import BlockHash, ChunkKey, ConversationId, as_block_hash


def chunks(*names: str, tokens: int = 4) -> list[Chunk]:
    return [make_chunk(f"text of {n}", id=n, num_tokens=tokens) for n in names]


def hashes_for(plan: Plan, tag: str = "") -> list[list[BlockHash]]:
    keys = plan.keys
    return [[BlockHash(f"{tag}{'/'.join(keys[: i + 1])}".encode())] for i in range(len(keys))]


def populated(clock: FakeClock | None = None, **config: Any) -> CraftPlanner:
    """A planner with a CP-Tree (spans, block hashes), a CA-Table and two conversations."""
    settings: dict[str, Any] = {"policy": "tree", "window": 8, "max_tree_nodes": 32}
    settings.update(config)
    planner = CraftPlanner(PlannerConfig(**settings), clock=clock or FakeClock(100.0))
    for names, conv in [
        (("A", "B", "C"), None),
        (("B", "A", "D"), "conv-1"),
        (("A", "B", "E"), "conv-1"),
        (("C", "D"), "conv-2"),
    ]:
        plan = planner.plan(chunks(*names), conv)
        planner.commit(plan, prefix_tokens=10, block_hashes=hashes_for(plan))
    planner._check_invariants()
    return planner


def snapshot(planner: CraftPlanner) -> tuple[str, dict[str, int]]:
    return json.dumps(planner.to_json(), sort_keys=True), dataclasses.asdict(planner.stats)


def refused(
    planner: CraftPlanner,
    call: Callable[[], object],
    error: type[BaseException],
    match: str,
) -> BaseException:
    """``call`` raises exactly ``error`` (message matching ``match``) and changes nothing."""
    before = snapshot(planner)
    with pytest.raises(error, match=match) as info:
        call()
    assert type(info.value) is error
    planner._check_invariants()
    assert snapshot(planner) == before
    return info.value


# ---- settings: bools where ints are meant, non-bools where bools are meant -------------------


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"window": True}, "window"),
        ({"window": 0}, "window"),
        ({"window": "10"}, "window"),
        ({"window": 2.0}, "window"),
        ({"threshold": True}, "threshold"),
        ({"threshold": 0}, "threshold"),
        ({"max_tree_nodes": True}, "max_tree_nodes"),
        ({"max_tree_nodes": 0}, "max_tree_nodes"),
        ({"max_tree_nodes": 2**70}, "max_tree_nodes"),
        ({"dedup": "no"}, "dedup"),
        ({"dedup": 0}, "dedup"),
        ({"dedup": None}, "dedup"),
        ({"max_conversations": False}, "max_conversations"),
        ({"max_conversations": -3}, "max_conversations"),
        ({"conversation_ttl_s": "1h"}, "conversation_ttl_s"),
        ({"conversation_ttl_s": 0}, "conversation_ttl_s"),
        ({"conversation_ttl_s": -5.0}, "conversation_ttl_s"),
        ({"conversation_ttl_s": math.nan}, "conversation_ttl_s"),
        ({"conversation_ttl_s": math.inf}, "conversation_ttl_s"),
        ({"conversation_ttl_s": True}, "conversation_ttl_s"),
        ({"conversation_ttl_s": 10**400}, "conversation_ttl_s"),
        ({"policy": None}, "policy"),
        ({"policy": ["tree"]}, "policy"),
        ({"promotion": 3}, "promotion"),
        ({"promotion": ["served"]}, "promotion"),
    ],
)
def test_planner_config_rejects_bad_settings(settings: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:") as info:
        PlannerConfig(**settings)
    assert type(info.value) is ValueError


def test_planner_config_accepts_the_edges() -> None:
    config = PlannerConfig(window=None, conversation_ttl_s=None, dedup=False, threshold=1)
    assert config.window is None and config.dedup is False
    assert PlannerConfig(conversation_ttl_s=1).conversation_ttl_s == 1  # an int of seconds


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: CraftPlanner(config={"policy": "tree"}), "config"),  # type: ignore[arg-type]
        (lambda: CraftPlanner(clock=5), "clock"),  # type: ignore[arg-type]
        (lambda: ChunkAccessTable(window=True), "window"),
        (lambda: ChunkAccessTable(window="5"), "window"),  # type: ignore[arg-type]
        (lambda: ChunkPrefixTree(True), "max_nodes"),
        (lambda: ChunkPrefixTree(4, clock=None), "clock"),  # type: ignore[arg-type]
        (lambda: ConversationRegistry(ttl_s="1h"), "ttl_s"),  # type: ignore[arg-type]
        (lambda: ConversationRegistry(max_conversations=True), "max_conversations"),
        (lambda: KVLocation(engine_id=""), "engine_id"),
        (lambda: KVLocation(tier=None), "tier"),  # type: ignore[arg-type]
        (lambda: NodeMetadata(token_span=(True, 3)), "token_span"),
        (lambda: NodeMetadata(token_span=(1, 2, 3)), "token_span"),  # type: ignore[arg-type]
        (lambda: NodeMetadata(block_hashes=("abc",)), "block_hashes"),  # type: ignore[arg-type]
        (lambda: SimulatedPrefixCache(block_size=True), "block_size"),
        (lambda: SimulatedPrefixCache(block_size="32"), "block_size"),  # type: ignore[arg-type]
        (lambda: SimulatedPrefixCache(capacity_tokens=2.5), "capacity_tokens"),  # type: ignore[arg-type]
    ],
)
def test_core_constructors_reject_bad_arguments(build: Callable[[], object], field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        build()
    assert type(info.value) is ValueError


# ---- chunks built directly or through make_chunk ----------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"key": None, "text": "x"}, "Chunk.key"),
        ({"key": "", "text": "x"}, "Chunk.key"),
        ({"key": 7, "text": "x"}, "Chunk.key"),
        ({"key": "k", "text": None}, "Chunk.text"),
        ({"key": "k", "text": b"bytes"}, "Chunk.text"),
        ({"key": "k", "text": "bad \ud800 surrogate"}, "Chunk.text"),
        ({"key": "k\udfff", "text": "x"}, "Chunk.key"),
        ({"key": "k", "text": "x", "num_tokens": -1}, "Chunk.num_tokens"),
        ({"key": "k", "text": "x", "num_tokens": True}, "Chunk.num_tokens"),
        ({"key": "k", "text": "x", "score": "high"}, "Chunk.score"),
        ({"key": "k", "text": "x", "score": False}, "Chunk.score"),
        ({"key": "k", "text": "x", "metadata": ["a"]}, "Chunk.metadata"),
    ],
)
def test_chunk_validates_at_construction(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        Chunk(**kwargs)
    assert type(info.value) is ValueError


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"text": "lone \udc80 surrogate"}, "'text'"),
        ({"text": "t", "id": "id\ud800"}, "'id'"),
        ({"text": "t", "score": math.nan}, "'score'"),
        ({"text": "t", "num_tokens": 2**80}, "'num_tokens'"),
        ({"text": "t", "metadata": "title"}, "'metadata'"),
    ],
)
def test_make_chunk_rejects_what_no_tokenizer_or_file_can_take(
    kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=field) as info:
        make_chunk(**kwargs)
    assert type(info.value) is ValueError


# ---- plan(): one-shot iterables, bad items, conversation ids ---------------------------------


def test_plan_reads_a_generator_exactly_once() -> None:
    planner = populated()
    reads = 0

    def gen() -> Iterator[Chunk]:
        nonlocal reads
        reads += 1
        yield from chunks("A", "B", "X")

    plan = planner.plan(gen())
    assert reads == 1 and sorted(plan.keys) == ["A", "B", "X"]
    planner.commit(plan)
    planner._check_invariants()


@pytest.mark.parametrize(
    "bad",
    [
        make_chunk("one chunk, not a list", id="solo"),
        "abc",
        None,
        {"A": make_chunk("x", id="A")},
        [make_chunk("x", id="A"), "not a chunk"],
        [make_chunk("x", id="A"), None],
    ],
)
def test_plan_rejects_what_is_not_an_iterable_of_chunks(bad: object) -> None:
    planner = populated()
    refused(planner, lambda: planner.plan(bad), ValueError, "chunk")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, 1, "", b"conv", True, 1.5, ["conv-1"], "c\ud800"])
def test_one_rule_for_conversation_ids(bad: object) -> None:
    planner = populated()
    refused(planner, lambda: planner.plan(chunks("A"), bad), ValueError, "conversation_id")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="conversation_id"):
        validation.validate_conversation_id(bad)
    assert validation.validate_conversation_id(None) is None
    assert validation.validate_conversation_id("0") == ConversationId("0")


def test_second_plan_of_a_conversation_in_flight_is_refused_until_commit_or_abort() -> None:
    planner = populated()
    first = planner.plan(chunks("A", "F"), "conv-1")
    assert planner.in_flight("conv-1")
    err = refused(
        planner, lambda: planner.plan(chunks("F", "G"), "conv-1"), RuntimeError, "in flight"
    )
    assert "conv-1" in str(err) and "abort" in str(err)
    # Other conversations and plain requests are not held up.
    planner.abort(planner.plan(chunks("F"), "conv-2"))
    planner.commit(planner.plan(chunks("F")))
    # abort() frees the conversation; the aborted plan can no longer be committed.
    assert planner.abort(first) and not planner.abort(first)
    with pytest.raises(RuntimeError, match="aborted"):
        planner.commit(first)
    second = planner.plan(chunks("F", "G"), "conv-1")
    assert second.turn == first.turn  # the aborted turn left no trace
    planner.commit(second)
    assert not planner.in_flight("conv-1")
    planner._check_invariants()


def test_a_plan_in_flight_past_the_conversation_ttl_is_abandoned() -> None:
    clock = FakeClock(100.0)
    planner = populated(clock, conversation_ttl_s=60.0)
    stale = planner.plan(chunks("A"), "conv-1")
    clock.now += 61.0
    fresh = planner.plan(chunks("B"), "conv-1")  # not stuck forever after a lost plan
    with pytest.raises(RuntimeError, match="too old"):
        planner.commit(stale)
    planner.commit(fresh)
    planner._check_invariants()


def test_end_conversation_releases_a_plan_in_flight() -> None:
    planner = populated()
    held = planner.plan(chunks("A"), "conv-2")
    assert planner.end_conversation("conv-2")
    assert not planner.in_flight("conv-2")
    planner.commit(planner.plan(chunks("B"), "conv-2"))
    planner.commit(held)  # still committable: records a turn of the fresh conversation
    planner._check_invariants()
    assert planner.end_conversation(None) is False  # type: ignore[arg-type]
    refused(planner, lambda: planner.end_conversation(0), ValueError, "conversation_id")  # type: ignore[arg-type]
    refused(planner, lambda: planner.forget_turns("conv-2", True), ValueError, "^n:")
    refused(planner, lambda: planner.forget_turns("conv-2", -1), ValueError, "^n:")


# ---- commit(): everything checked before anything changes ------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prefix_tokens": -1}, "prefix_tokens"),
        ({"prefix_tokens": True}, "prefix_tokens"),
        ({"prefix_tokens": "10"}, "prefix_tokens"),
        ({"prefix_tokens": 2**64}, "prefix_tokens"),
        ({"chunk_token_counts": [5, -1]}, r"chunk_token_counts\[1\]"),
        ({"chunk_token_counts": [True, 2]}, r"chunk_token_counts\[0\]"),
        ({"chunk_token_counts": [2.5, 2]}, r"chunk_token_counts\[0\]"),
        ({"chunk_token_counts": [1, 2, 3]}, "chunk_token_counts"),
        ({"chunk_token_counts": 5}, "chunk_token_counts"),
        ({"chunk_token_counts": [2**62, 2**62]}, "chunk_token_counts"),
        ({"reused_chunks": True}, "reused_chunks"),
        ({"reused_chunks": -1}, "reused_chunks"),
        ({"reused_chunks": 3}, "reused_chunks"),
        ({"reused_chunks": "1"}, "reused_chunks"),
        ({"block_hashes": [["abc"], [b"x"]]}, r"block_hashes\[0\]\[0\]"),
        ({"block_hashes": [[b"x"], [1.5]]}, r"block_hashes\[1\]\[0\]"),
        ({"block_hashes": [[True], [b"x"]]}, r"block_hashes\[0\]\[0\]"),
        ({"block_hashes": [[b""], [b"x"]]}, r"block_hashes\[0\]\[0\]"),
        ({"block_hashes": [[b"x"]]}, "block_hashes"),
        ({"block_hashes": [7, 8]}, r"block_hashes\[0\]"),
        ({"block_hashes": [[2**600], [1]]}, r"block_hashes\[0\]\[0\]"),
        ({"location": "gpu1"}, "location"),
    ],
)
def test_rejected_commit_changes_nothing(kwargs: dict[str, Any], field: str) -> None:
    planner = populated()
    plan = planner.plan(chunks("A", "Z"))
    refused(planner, lambda: planner.commit(plan, **kwargs), ValueError, field)
    assert planner.is_pending(plan)
    planner.commit(plan, prefix_tokens=10)  # the refused commit left the plan committable
    planner._check_invariants()


def test_commit_refuses_a_plan_altered_after_planning() -> None:
    planner = populated()
    plan = planner.plan(chunks("A", "Z"))
    doubled = dataclasses.replace(plan, ordered=(plan.ordered[0], plan.ordered[0]))
    refused(planner, lambda: planner.commit(doubled), ValueError, "repeat a key")
    swapped = dataclasses.replace(plan, ordered=tuple(chunks("Q", "R")))
    refused(planner, lambda: planner.commit(swapped), ValueError, "altered")
    refused(planner, lambda: planner.commit(object()), ValueError, "plan")  # type: ignore[arg-type]
    planner.commit(plan)


def test_int_block_hashes_are_normalised_and_round_trip() -> None:
    """vLLM's server reports 64-bit int hashes, the in-process engine bytes: one canonical
    type (bytes) in the tree, so save/load and KV events agree on both."""
    planner = populated()
    plan = planner.plan(chunks("P", "Q"))
    planner.commit(plan, prefix_tokens=10, block_hashes=[[2**63 + 5], [-7, BlockHash(b"q-bytes")]])
    loaded = CraftPlanner.from_json(json.loads(json.dumps(planner.to_json())))
    loaded._check_invariants()
    assert loaded.to_json() == planner.to_json()
    assert as_block_hash(-7) in planner.prefix_tree._by_block
    for twin in (planner, loaded):
        assert twin.on_blocks_removed([-7]) == 1  # the int names the same block
        twin._check_invariants()


def test_varying_prefix_tokens_drops_the_stale_subtree() -> None:
    """Defined (not refused): a head of another length moves a cached chunk's span, so the
    nodes recorded below it under the old span are stale and dropped; spans stay contiguous."""
    planner = populated(policy="retriever", promotion="served")
    first = planner.plan(chunks("H1", "H2", "H3"))
    planner.commit(first, prefix_tokens=10)
    again = planner.plan(chunks("H1", "H4"))
    planner.commit(again, prefix_tokens=13)
    planner._check_invariants()
    paths = {tuple(p) for p in planner.prefix_tree.iter_paths()}
    assert ("H1", "H4") in paths and ("H1", "H2") not in paths
    node = planner.prefix_tree.match([ChunkKey("H1")]).nodes[0]
    assert (node.token_start, node.token_end) == (13, 17)


# ---- KV events, tree, table and registry used directly ---------------------------------------


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda p: p.on_blocks_removed(["A"]), r"hashes\[0\]"),
        (lambda p: p.on_blocks_removed([b"A/B/C", True]), r"hashes\[1\]"),
        (lambda p: p.on_blocks_removed(b"A/B/C"), "hashes"),
        (lambda p: p.on_blocks_removed([[b"A"]]), r"hashes\[0\]"),
        (lambda p: p.on_blocks_moved([b"A"], "cpu"), "location"),
        (lambda p: p.prefix_tree.insert([ChunkKey("A"), None]), r"keys\[1\]"),
        (lambda p: p.prefix_tree.insert(ks("N1", "N1")), "repeat"),
        (
            lambda p: p.prefix_tree.insert(
                ks("N1", "N2"), metadata=[NodeMetadata((0, 5)), NodeMetadata((7, 9))]
            ),
            "contiguous",
        ),
        (lambda p: p.prefix_tree.insert(ks("N1"), metadata=[(0, 4)]), r"metadata\[0\]"),
        (lambda p: p.prefix_tree.remove(ChunkPrefixTree().insert(ks("X")).nodes[0]), "another"),
        (lambda p: p.prefix_tree.remove("A"), "node"),
        (lambda p: p.access_table.record([ChunkKey("A"), None]), r"keys\[1\]"),
        (lambda p: p.access_table.record("ABC"), "keys"),
        (lambda p: p.conversations.record_turn(ConversationId("conv-1"), ks("A", "A")), "ordered"),
        (lambda p: p.conversations.record_turn(5, ks("A")), "conversation_id"),
    ],
)
def test_direct_calls_on_the_parts_are_checked_first(
    call: Callable[[CraftPlanner], object], field: str
) -> None:
    planner = populated()
    refused(planner, lambda: call(planner), ValueError, field)


def ks(*names: str) -> list[ChunkKey]:
    return [ChunkKey(n) for n in names]


def test_kv_events_read_a_generator_once() -> None:
    planner = populated()
    before = len(planner.prefix_tree)
    removed = planner.on_blocks_removed(BlockHash(h) for h in [b"A/B/C", b"nothing"])
    assert removed >= 1 and len(planner.prefix_tree) == before - removed
    planner._check_invariants()


# ---- registries and the simulator ------------------------------------------------------------


@pytest.mark.parametrize("name", [None, ["tree"], 3, "Tree"])
def test_policy_and_promotion_lookups_name_the_valid_options(name: object) -> None:
    with pytest.raises(ValueError, match="choose one of") as info:
        get_policy(name)  # type: ignore[arg-type]
    assert type(info.value) is ValueError
    with pytest.raises(ValueError, match="choose one of") as info2:
        get_promotion_rule(name)  # type: ignore[arg-type]
    assert type(info2.value) is ValueError
    with pytest.raises(ValueError, match="choose one of") as info3:
        get_routing_policy(name)  # type: ignore[arg-type]
    assert type(info3.value) is ValueError


def test_registry_lookups_name_what_they_look_up_and_every_valid_name() -> None:
    expected = {
        get_policy: "unknown ordering policy 'x'; choose one of ['frequency', 'retriever', 'tree']",
        get_promotion_rule: "unknown promotion rule 'x'; choose one of ['served', 'threshold']",
        get_routing_policy: (
            "unknown routing policy 'x'; choose one of "
            "['craft_joint', 'least_loaded', 'prefix_blocks', 'prefix_craft_order', "
            "'prefix_fixed_order', 'round_robin']"
        ),
    }
    for lookup, message in expected.items():
        with pytest.raises(ValueError) as info:
            lookup("x")
        assert str(info.value) == message
    assert get_routing_policy("craft_joint") is not get_routing_policy("craft_joint")


@pytest.mark.parametrize("tokens", [["a", "b"], [1.5, 2.0], [2**70, 1]])
def test_simulated_cache_rejects_non_token_ids(tokens: list[Any]) -> None:
    cache = SimulatedPrefixCache(block_size=2, capacity_tokens=64)
    cache.serve([1, 2, 3, 4, 5])
    before = list(cache._blocks)
    with pytest.raises(ValueError, match="tokens") as info:
        cache.serve(tokens)
    assert type(info.value) is ValueError
    assert list(cache._blocks) == before


# ---- save(): atomic, private, never through a symlink, safe under concurrency ----------------


def test_save_leaves_a_symlink_at_the_old_temp_name_alone(tmp_path: Path) -> None:
    planner = populated()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    target = tmp_path / "state.json"
    (tmp_path / "state.json.tmp").symlink_to(victim)
    planner.save(target)
    assert victim.read_text() == "keep me"
    assert (tmp_path / "state.json.tmp").is_symlink()
    assert CraftPlanner.load(target).to_json() == planner.to_json()


def test_save_leaves_an_unrelated_temp_file_alone(tmp_path: Path) -> None:
    planner = populated()
    other = tmp_path / "state.json.tmp"
    other.write_text("someone else's")
    planner.save(tmp_path / "state.json")
    assert other.read_text() == "someone else's"


def test_save_to_a_directory_fails_first_and_leaves_nothing(tmp_path: Path) -> None:
    planner = populated()
    folder = tmp_path / "state.json"
    folder.mkdir()
    with pytest.raises(IsADirectoryError):
        planner.save(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    assert list(folder.iterdir()) == []


def test_save_is_private_and_loads_back(tmp_path: Path) -> None:
    planner = populated()
    target = tmp_path / "state.json"
    target.write_text("old")
    os.chmod(target, 0o644)
    planner.save(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600  # conversation ids are private
    CraftPlanner.load(target)._check_invariants()


def test_concurrent_saves_of_one_planner_all_succeed(tmp_path: Path) -> None:
    planner = populated()
    target = tmp_path / "state.json"
    errors: list[BaseException] = []
    start = threading.Barrier(16)

    def save() -> None:
        try:
            start.wait()
            for _ in range(5):
                planner.save(target)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=save) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert CraftPlanner.load(target).to_json() == planner.to_json()
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temp file left


def test_load_names_the_file_for_text_that_is_not_state(tmp_path: Path) -> None:
    for name, data in [
        ("binary.json", b"\xff\xfe\x00garbage"),
        ("truncated.json", b'{"format": "craft-rag/planner/v1", "config": {'),
        ("deep.json", b"[" * 100_000 + b"]" * 100_000),
        ("bigint.json", b'{"format": "craft-rag/planner/v1", "config": ' + b"9" * 5000 + b"}"),
    ]:
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ValueError, match=name) as info:
            CraftPlanner.load(path)
        assert type(info.value) is ValueError
    with pytest.raises(FileNotFoundError):
        CraftPlanner.load(tmp_path / "missing.json")


# ---- metrics and lookups ---------------------------------------------------------------------


def test_overlap_metrics_read_generators_once() -> None:
    from craft_rag.metrics import prefix_overlap, total_overlap

    rows = [["a", "b"], ["a", "c"]]
    assert prefix_overlap(iter(r) for r in rows) == prefix_overlap(rows) == 0.5
    assert total_overlap(r for r in rows) == total_overlap(rows) == 0.5


@pytest.mark.parametrize(
    ("requests", "field"),
    [
        (None, "requests"),
        ("ab", "requests"),
        ([["a"], "ab"], r"requests\[1\]"),
        ([["a"], [["x"]]], r"requests\[1\]\[0\]"),
        ([["a"], 5], r"requests\[1\]"),
    ],
)
def test_overlap_metrics_reject_malformed_requests(requests: Any, field: str) -> None:
    from craft_rag.metrics import prefix_overlap, total_overlap

    for metric in (prefix_overlap, total_overlap):
        with pytest.raises(ValueError, match=field) as info:
            metric(requests)
        assert type(info.value) is ValueError


@pytest.mark.parametrize(
    "call",
    [
        lambda p: p.prefix_tree.match([["A"]]),
        lambda p: p.prefix_tree.match(5),
        lambda p: p.prefix_tree.match_subset([{"A": 1}]),
        lambda p: p.access_table.count(["A"]),
        lambda p: p.access_table.counts([ChunkKey("A"), ["B"]]),
    ],
)
def test_lookups_with_unhashable_keys_are_value_errors(
    call: Callable[[CraftPlanner], object],
) -> None:
    planner = populated()
    refused(planner, lambda: call(planner), ValueError, "key")


def test_registry_split_reads_a_generator_once() -> None:
    planner = populated()
    sent_before = planner.conversations.turns(ConversationId("conv-1"))
    assert sent_before
    pool = chunks("A", "Q", "B")
    new, seen = planner.conversations.split(ConversationId("conv-1"), (c for c in pool))
    assert [c.key for c in new] == ["Q"] and sorted(c.key for c in seen) == ["A", "B"]


@pytest.mark.parametrize("name", ["retriever", "frequency", "tree"])
def test_every_ordering_policy_reads_a_generator_once(name: str) -> None:
    from craft_rag.ordering import OrderingContext

    planner = populated()
    pool = chunks("C", "A", "B", "Q")
    context = OrderingContext(planner.access_table, planner.prefix_tree)
    once = get_policy(name).order((c for c in pool), context)  # type: ignore[arg-type]
    assert once == get_policy(name).order(pool, context)
    assert sorted(c.key for c in once) == ["A", "B", "C", "Q"]
