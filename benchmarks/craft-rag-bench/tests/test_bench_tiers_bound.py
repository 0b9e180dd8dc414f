"""The ``tiers`` suite's load-free bound (:mod:`craft_rag_bench.bench.tiers_bound`) on a
synthetic trace whose cached tokens are counted by hand, the KV bytes of a block, and the
``--bound-only`` path through the suite and the CLI (no engine)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from bench_cli_spy import spy_run_suites

from craft_rag.chunk import make_chunk
from craft_rag.prompt import PromptAssembler, PromptFormat
from craft_rag.tokenizer import HashingTokenizer
from craft_rag.trace import TraceRequest, write_trace
from craft_rag.types import ConversationId
from craft_rag_bench.bench import tiers
from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.tiers_bound import bound, kv_block_bytes, simulate_cached

BLOCK = 4
# One token per word, nothing around the chunks: chunk X is exactly one block of 4 tokens, the
# question 2 tokens, so each prompt below is 2 blocks + 2 tokens (10 tokens; a lookup reads at
# most 9, i.e. the 2 chunk blocks).
FORMAT = PromptFormat(head="", chunk="{text} ", question="{question}", tail="")


def chunk(name: str) -> Any:
    return make_chunk(" ".join(f"{name}{i}" for i in range(BLOCK)), id=name)


def request(i: int, *names: str) -> TraceRequest:
    return TraceRequest(id=f"q{i}", query="what now", chunks=tuple(chunk(n) for n in names))


# 1: [A B]; 2: [B A] (CRAFT puts A first: 2 blocks hit; the retriever's B-first prompt misses);
# 3: [C D] (new); 4: [B A] again.
TRACE = [request(1, "A", "B"), request(2, "B", "A"), request(3, "C", "D"), request(4, "B", "A")]
PROMPT = 4 * 10


def assembler() -> PromptAssembler:
    return PromptAssembler(HashingTokenizer(), FORMAT)


def test_prompts_are_the_sizes_the_hand_counts_assume() -> None:
    prompt = assembler().single_turn(TRACE[0].chunks, TRACE[0].query)
    assert prompt.num_tokens == 10 and prompt.chunk_spans == ((0, 4), (4, 8))


def test_unbounded_cache_counts_by_hand() -> None:
    a = assembler()
    # CRAFT: request 2 and request 4 hit A,B (8 tokens each); nothing is ever evicted.
    craft = simulate_cached(TRACE, a, "tree", BLOCK)
    assert (craft.prompt_tokens, craft.cached_tokens, craft.evicted_blocks) == (PROMPT, 16, 0)
    assert craft.resident_blocks == 4  # A, AB, C, CD
    # Retriever order: only request 4 repeats request 2's B-first prompt.
    prefix = simulate_cached(TRACE, a, "retriever", BLOCK)
    assert (prefix.cached_tokens, prefix.resident_blocks) == (8, 6)  # + B, BA


def test_a_two_block_pool_loses_what_request_three_pushed_out() -> None:
    a = assembler()
    # Request 3's two blocks evict A and AB; the CP-Tree hears it, request 4 hits nothing.
    craft = simulate_cached(TRACE, a, "tree", BLOCK, capacity_blocks=2)
    assert (craft.cached_tokens, craft.evicted_blocks) == (8, 4)
    assert simulate_cached(TRACE, a, "retriever", BLOCK, capacity_blocks=2).cached_tokens == 0


def test_three_blocks_keep_a_but_not_ab() -> None:
    # After request 2 the LRU order is AB (older), A; request 3 evicts AB only. The CP-Tree
    # drops B under A, still orders request 4 A first: one block (4 tokens) hits.
    craft = simulate_cached(TRACE, assembler(), "tree", BLOCK, capacity_blocks=3)
    assert craft.cached_tokens == 8 + 4


def test_a_planner_blind_to_the_tiers_misses_what_they_hold() -> None:
    # Pool 2 blocks, tiers enough for everything: request 3 pushes A and AB out of the pool,
    # the CP-Tree hears it and forgets A->B, so request 4 goes out in the retriever's B-first
    # order and misses the A-first blocks the tier still holds (seen: 8 tokens, not 16).
    a = assembler()
    blind = simulate_cached(TRACE, a, "tree", BLOCK, 100, heard_blocks=2)
    assert (blind.cached_tokens, blind.evicted_blocks, blind.resident_blocks) == (8, 0, 6)
    assert simulate_cached(TRACE, a, "tree", BLOCK, 100).cached_tokens == 16
    with pytest.raises(ValueError, match="heard_blocks"):
        simulate_cached(TRACE, a, "tree", BLOCK, heard_blocks=0)


def test_bound_fields_by_hand() -> None:
    a = assembler()
    args: dict[str, Any] = {"block_size": BLOCK, "pool_blocks": 2, "block_bytes": 100,
                            "ram_bytes": 150, "disk_bytes": 0}  # tiers: 1 block
    b = bound(TRACE, a, **args)
    assert (b["unbounded_craft"], b["unbounded_prefix"]) == (16 / PROMPT, 8 / PROMPT)
    assert (b["pool_only_craft"], b["pool_only_prefix"]) == (8 / PROMPT, 0.0)
    assert b["pool_plus_tiers_craft"] == 12 / PROMPT  # 3 blocks in all
    assert b["pool_plus_tiers_craft_blind"] == 8 / PROMPT  # request 4 sent B first: no hit
    assert b["max_cached_ratio_over_craft"] == 2.0 and b["ratio_reference"] == "pool_only_craft"
    assert b["pool_plus_tiers_ratio_over_craft"] == pytest.approx(1.5)
    assert b["tier_blocks"] == {"ram": 1, "disk": 0} and b["distinct_blocks"] == 4
    assert b["prompt_tokens"] == PROMPT
    # The engine's measured craft fraction is the denominator when it ran.
    measured = bound(TRACE, a, craft_measured=0.25, **args)
    assert measured["max_cached_ratio_over_craft"] == (16 / PROMPT) / 0.25
    assert measured["ratio_reference"] == "craft_measured"
    # Tiers holding every distinct block give the unbounded result.
    big = bound(TRACE, a, **{**args, "disk_bytes": 1000})
    assert big["pool_plus_tiers_craft"] == big["unbounded_craft"]
    assert big["pool_plus_tiers_craft_blind"] == 8 / PROMPT
    assert big["evicted_blocks"]["pool_plus_tiers_craft"] == 0
    with pytest.raises(ValueError, match="block_bytes"):
        bound(TRACE, a, **{**args, "block_bytes": 0})


def test_bad_inputs() -> None:
    turn = TraceRequest(id="c1", query="q", chunks=(chunk("A"),),
                        conversation_id=ConversationId("c"))
    with pytest.raises(ValueError, match="single-turn"):
        simulate_cached([turn], assembler(), "tree", BLOCK)
    with pytest.raises(ValueError, match="policy"):
        simulate_cached(TRACE, assembler(), "nope", BLOCK)
    with pytest.raises(ValueError, match="capacity_blocks"):
        simulate_cached(TRACE, assembler(), "tree", BLOCK, capacity_blocks=0)


def test_kv_block_bytes() -> None:
    smollm = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
              "head_dim": 64, "hidden_size": 576}
    assert kv_block_bytes(smollm, 32, "float32") == 30 * 3 * 64 * 2 * 32 * 4 == 1_474_560
    assert kv_block_bytes(smollm, 32, "bfloat16") == 1_474_560 // 2
    no_head_dim = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    assert kv_block_bytes(no_head_dim, 8, "float32") == 2 * 4 * 16 * 2 * 8 * 4
    with pytest.raises(ValueError, match="num_hidden_layers"):
        kv_block_bytes({"num_attention_heads": 4}, 8, "float32")
    with pytest.raises(ValueError, match="float32"):
        kv_block_bytes(smollm, 32, "int3")


def test_bound_only_runs_no_engine_and_keeps_the_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(TRACE, trace)

    class Lent:
        planner = None

    lent: Any = Lent()  # an engine handed in: the bound needs none, so it still runs
    ctx = BenchContext(engine=lent, trace_path=trace, block_size=BLOCK, progress=False)
    ctx.with_sizes(tiers_bound_only=True, tiers_pool_requests=1)
    monkeypatch.setattr(tiers, "model_block_bytes", lambda block_size: 100)
    monkeypatch.setattr(tiers, "side_by_side", lambda *a, **k: pytest.fail("engine ran"))
    monkeypatch.setattr(BenchContext, "tokenizer", lambda self: HashingTokenizer())
    monkeypatch.setattr(BenchContext, "prompt_format", lambda self: FORMAT)
    out = tiers.run(ctx)
    assert out["bound_only"] is True and "skipped" not in out
    w = out["workloads"]["trace"]
    assert (w["systems"], w["verdicts"]) == ({}, {})
    # The pool holds the largest request (18 tokens with 8 reply tokens: 5 blocks) plus one:
    # 6 blocks, more than CRAFT's 4 distinct ones, so the pool alone reaches the bound.
    assert w["pool_blocks"] == w["bound"]["pool_blocks"] == 6
    assert w["bound"]["unbounded_craft"] == w["bound"]["pool_only_craft"] == 16 / PROMPT
    assert set(w["bound"]) == {
        "unbounded_craft", "unbounded_prefix", "pool_only_craft", "pool_only_prefix",
        "pool_plus_tiers_craft", "pool_plus_tiers_craft_blind", "max_cached_ratio_over_craft",
        "ratio_reference",
        "pool_plus_tiers_ratio_over_craft", "pool_blocks", "block_bytes", "tier_blocks",
        "distinct_blocks", "evicted_blocks", "prompt_tokens"}
    json.dumps(w, allow_nan=False)
    lines = tiers.report_lines(out)
    assert not any(line.startswith("| system |") for line in lines)
    assert any(line.startswith("- Bound (no engine") and "at most 1.00x" in line
               for line in lines)


def test_cli_bound_only_flag_reaches_the_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from craft_rag.cli import build_parser
    from craft_rag_bench.bench import cli

    seen = spy_run_suites(monkeypatch)
    for flags, expected in (([], False), (["--bound-only"], True)):
        args = build_parser().parse_args(
            ["bench", "tiers", *flags, "--out", str(tmp_path / "out")])
        assert cli.run_bench(args) == 0
        assert seen[-1].sizes.tiers_bound_only is expected
