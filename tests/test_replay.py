"""Trace replay through the planner and the simulated prefix cache, and the `replay` CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from craft_rag.chunk import make_chunk
from craft_rag.cli import main
from craft_rag.metrics import chunks_with_cached_blocks
from craft_rag.planner import PlannerConfig
from craft_rag.prompt import AssembledPrompt, PromptAssembler
from craft_rag.replay import ReplayResult, ServedRequest, percentile, replay, reused_chunk_count
from craft_rag.tokenizer import HashingTokenizer
from craft_rag.trace import TraceRequest, write_trace

BLOCK = 4

TEXTS = {
    name: f"Passage {name} tells a long and detailed story number {i} about topic {name} "
    f"with enough words to fill several cache blocks of tokens."
    for i, name in enumerate(["A", "B", "H", "X", "Y", "C1", "C2", "C3", "C4", "C5", "C6", "C7"])
}


def request(
    rid: str, names: list[str], query: str = "What happened?", **extra: Any
) -> TraceRequest:
    chunks = tuple(make_chunk(TEXTS[n], id=n, score=1.0) for n in names)
    return TraceRequest(rid, query, chunks, **extra)


def run(
    requests: list[TraceRequest], policy: str, **config: Any
) -> tuple[list[ServedRequest], ReplayResult]:
    served: list[ServedRequest] = []
    result = replay(
        requests,
        PlannerConfig(policy=policy, **config),
        HashingTokenizer(),
        block_size=BLOCK,
        cache_tokens=1 << 16,
        on_served=served.append,
    )
    return served, result


# ---- the paper's metrics on the order fed to the engine ------------------------------------------

SECTION_3_1 = [
    request("r1", ["C1", "C4", "C5", "C6", "C7"], "first"),
    request("r2", ["C1", "C2", "C3", "C4", "C5"], "second"),
]


def test_section_3_1_under_the_retriever_order() -> None:
    served, result = run(SECTION_3_1, "retriever")
    assert result.prefix_overlap == pytest.approx(1 / 5)
    assert result.total_overlap == pytest.approx(3 / 5)
    assert [s.reused_chunks for s in served] == [0, 1]  # only C1 is prefix-aligned
    assert result.reused_chunk_fraction == pytest.approx(1 / 10)


@pytest.mark.parametrize("policy", ["frequency", "tree"])
def test_section_3_1_reordering_triples_the_reuse(policy: str) -> None:
    served, result = run(SECTION_3_1, policy)
    assert served[1].prompt.chunk_keys == ("C1", "C4", "C5", "C2", "C3")  # Request'_2
    assert result.prefix_overlap == pytest.approx(3 / 5)
    assert result.total_overlap == pytest.approx(3 / 5)
    assert [s.reused_chunks for s in served] == [0, 3]
    assert result.chunks_reused == 3 and result.chunks_rendered == 10


# ---- fact (a): frequency can re-order a repeated chunk set; tree gives the cached order back -----

DRIFT_TRACE = [
    request("r0", ["H"], "warm-up"),
    request("r1", ["H"], "warm-up again"),  # H:2 is the hottest chunk
    request("r2", ["A", "B"], "same question"),  # A:0, B:0 -> [A, B] by key
    request("r3", ["H", "B"], "other question"),  # B's count grows between the repeats ...
    request("r4", ["H", "B"], "third question"),  # ... behind H, so no prompt starts with B
    request("r5", ["A", "B"], "same question"),  # the same chunk set (and question) again
]


def test_frequency_reorders_a_repeated_set_and_misses_the_cache() -> None:
    served, _ = run(DRIFT_TRACE, "frequency")
    assert served[2].prompt.chunk_keys == ("A", "B")
    assert [s.prompt.chunk_keys for s in served[3:5]] == [("H", "B"), ("H", "B")]
    assert served[5].prompt.chunk_keys == ("B", "A")  # A:1, B:3 -> a new order
    assert served[5].reused_chunks == 0  # the repeat misses
    first_chunk_blocks = served[5].prompt.chunk_spans[0][1] // BLOCK * BLOCK
    assert served[5].cached_tokens < first_chunk_blocks  # little more than the instructions


def test_tree_gives_a_repeated_set_its_cached_order_and_hits_fully() -> None:
    served, _ = run(DRIFT_TRACE, "tree")
    assert served[5].prompt.chunk_keys == served[2].prompt.chunk_keys == ("A", "B")
    assert served[5].prompt.token_ids == served[2].prompt.token_ids
    assert served[5].reused_chunks == 2
    tokens = served[5].prompt.num_tokens
    assert served[5].cached_tokens == (tokens - 1) // BLOCK * BLOCK  # all but the last block


def test_retriever_order_hits_the_repeat_too() -> None:
    served, _ = run(DRIFT_TRACE, "retriever")
    assert served[5].reused_chunks == 2


# ---- conversations -------------------------------------------------------------------------------


def test_two_turn_dedup_and_append_only_history() -> None:
    trace = [
        request("t1", ["C1", "C2", "C3"], "turn one", conversation_id="conv", turn=1,
                answer="The answer."),
        request("t2", ["C2", "C3", "C4"], "turn two", conversation_id="conv", turn=2),
    ]
    served, result = run(trace, "tree")
    assert served[1].prompt.chunk_keys == ("C4",)
    assert served[1].removed_by_dedup == 2
    assert result.dedup_removed_fraction == pytest.approx(2 / 6)
    first = served[0].prompt.token_ids
    assert served[1].prompt.token_ids[: len(first)] == first  # turn 2 extends turn 1
    assert served[1].cached_tokens == len(first) // BLOCK * BLOCK


def test_no_dedup_keeps_every_chunk() -> None:
    trace = [
        request("t1", ["C1", "C2"], conversation_id="conv"),
        request("t2", ["C2", "C3"], conversation_id="conv"),
    ]
    served, result = run(trace, "retriever", dedup=False)
    assert served[1].prompt.chunk_keys == ("C2", "C3")
    assert result.dedup_removed_fraction == 0.0


def test_result_accounting_is_consistent() -> None:
    trace = [request(f"r{i}", names) for i, names in enumerate(
        [["A", "B", "X"], ["B", "A"], ["X", "Y", "A"], ["A", "B", "X"]]
    )]
    served, result = run(trace, "tree")
    r = result
    assert r.requests == 4
    assert r.prompt_tokens == sum(s.prompt.num_tokens for s in served)
    assert r.cached_tokens == sum(s.cached_tokens for s in served)
    assert r.reused_token_fraction == pytest.approx(
        r.cached_tokens / r.prompt_tokens
    )
    assert r.chunks_retrieved == 11 and r.chunks_rendered == 11
    assert r.planner_us_p50 <= r.planner_us_p99
    assert r.tokenizer == "hashing-fallback" and r.block_size == BLOCK
    assert set(r.to_json()) >= {"policy", "requests", "prefix_overlap"}


def test_empty_trace() -> None:
    _, result = run([], "tree")
    assert result.requests == 0 and result.reused_chunk_fraction == 0.0


# ---- helpers -------------------------------------------------------------------------------------


def test_reused_chunk_count_needs_every_token_cached() -> None:
    prompt = AssembledPrompt(
        token_ids=tuple(range(40)),
        chunk_keys=("a", "b", "c"),
        chunk_spans=((6, 14), (14, 23), (23, 35)),
        prefix_tokens=6,
    )
    # a chunk counts only when every one of its tokens is cached
    assert reused_chunk_count(prompt, 12, 4) == 0  # a ends at 14
    assert reused_chunk_count(prompt, 16, 4) == 1
    assert reused_chunk_count(prompt, 20, 4) == 1  # b ends at 23
    assert reused_chunk_count(prompt, 24, 4) == 2
    assert reused_chunk_count(prompt, 32, 4) == 2  # c ends at 35
    assert reused_chunk_count(prompt, 36, 4) == 3
    assert reused_chunk_count(prompt, 0, 4) == 0
    # the planner's block-granular evidence: a's full blocks end at 12, b's at 20, c's at 32
    spans = prompt.chunk_spans
    assert [chunks_with_cached_blocks(spans, n, 4) for n in (0, 8, 12, 20, 32)] == [0, 0, 1, 2, 3]
    # cold: a chunk with no full block of its own needs all its tokens cached
    assert chunks_with_cached_blocks(((1, 3), (3, 7)), 0, 8) == 0
    assert chunks_with_cached_blocks(((1, 3), (3, 7)), 7, 8) == 2


def test_reused_chunk_count_on_a_real_prompt() -> None:
    asm = PromptAssembler(HashingTokenizer())
    prompt = asm.single_turn([make_chunk(TEXTS["A"], id="A")], "q")
    end = prompt.chunk_spans[0][1]
    assert reused_chunk_count(prompt, end, BLOCK) == 1
    assert reused_chunk_count(prompt, end - 1, BLOCK) == 0


def test_percentile_nearest_rank() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0
    assert percentile([3.0, 1.0, 2.0], 100) == 3.0
    values = [float(v) for v in range(101)]
    assert percentile(values, 99) == 99.0


# ---- the CLI -------------------------------------------------------------------------------------


def write(tmp_path: Path, requests: list[TraceRequest]) -> str:
    path = tmp_path / "trace.jsonl"
    write_trace(requests, path)
    return str(path)


REQUIRED_KEYS = {
    "requests",
    "prefix_overlap",
    "total_overlap",
    "reused_chunk_fraction",
    "reused_token_fraction",
    "dedup_removed_fraction",
    "planner_us_p50",
    "planner_us_p99",
}


def test_cli_replay_json_one_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, SECTION_3_1)
    rc = main(["replay", path, "--policy", "frequency", "--json", "--tokenizer", "fallback",
               "--block-size", str(BLOCK)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= REQUIRED_KEYS
    assert out["requests"] == 2 and out["policy"] == "frequency"
    assert out["prefix_overlap"] == pytest.approx(3 / 5)
    assert out["total_overlap"] == pytest.approx(3 / 5)
    assert out["reused_chunk_fraction"] == pytest.approx(3 / 10)
    assert out["block_size"] == BLOCK


def test_cli_replay_json_all_policies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, DRIFT_TRACE)
    assert main(["replay", path, "--json", "--tokenizer", "fallback"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 6
    assert set(out["policies"]) == {"retriever", "frequency", "tree"}
    for result in out["policies"].values():
        assert set(result) >= REQUIRED_KEYS


def test_cli_replay_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, DRIFT_TRACE)
    assert main(["replay", path, "--tokenizer", "fallback", "--window", "10", "--threshold", "3",
                 "--cache-tokens", "4096", "--block-size", "8"]) == 0
    out = capsys.readouterr().out
    for policy in ("retriever", "frequency", "tree"):
        assert any(row.strip().startswith(policy) for row in out.splitlines())
    assert "6 requests" in out and "block 8" in out and "cache 4096" in out


def test_cli_options_reach_the_planner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = [
        request("t1", ["C1", "C2"], conversation_id="c"),
        request("t2", ["C2", "C3"], conversation_id="c"),
    ]
    path = write(tmp_path, trace)
    args = ["replay", path, "--policy", "retriever", "--json", "--tokenizer", "fallback"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["dedup_removed_fraction"] == pytest.approx(1 / 4)
    assert main([*args, "--no-dedup"]) == 0
    assert json.loads(capsys.readouterr().out)["dedup_removed_fraction"] == 0.0
    assert main([*args, "--unlimited-window", "--promotion", "served"]) == 0


def test_cli_malformed_trace_reports_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.jsonl"
    good = json.dumps(request("r1", ["A"]).to_json())
    path.write_text("\n".join([good, good, '{"id": "r3", "query": "q", "chunks": [{}]}']) + "\n")
    rc = main(["replay", str(path), "--tokenizer", "fallback"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "trace line 3" in err and "'id'" in err


def test_cli_missing_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(tmp_path / "missing.jsonl"), "--tokenizer", "fallback"]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_cli_rejects_an_unknown_policy(tmp_path: Path) -> None:
    path = write(tmp_path, SECTION_3_1)
    with pytest.raises(SystemExit) as info:
        main(["replay", path, "--policy", "random"])
    assert info.value.code == 2


def test_max_model_len_drops_oldest_turns_like_the_engine() -> None:
    """Each turn adds ~40 hashing tokens; a 100-token budget keeps only the newest turns, and
    a turn that cannot fit alone is a clear error, never a cut chunk."""
    from craft_rag.chunk import make_chunk
    from craft_rag.planner import PlannerConfig
    from craft_rag.replay import replay
    from craft_rag.tokenizer import HashingTokenizer
    from craft_rag.trace import TraceRequest

    words = " ".join(f"w{i}" for i in range(30))
    turns = [
        TraceRequest(
            id=f"t{i}",
            query="q?",
            chunks=(make_chunk(words, id=f"c{i}"),),
            conversation_id="conv",  # type: ignore[arg-type]
            turn=i + 1,
            answer="a",
        )
        for i in range(4)
    ]
    seen: list[int] = []
    unlimited = replay(turns, PlannerConfig(), HashingTokenizer(), block_size=4)
    bounded = replay(
        turns,
        PlannerConfig(),
        HashingTokenizer(),
        block_size=4,
        max_model_len=100,
        on_served=lambda s: seen.append(s.prompt.num_tokens),
    )
    assert all(n <= 100 for n in seen)
    assert bounded.prompt_tokens < unlimited.prompt_tokens
    with pytest.raises(ValueError, match="even without earlier turns"):
        replay(turns, PlannerConfig(), HashingTokenizer(), max_model_len=20)


def test_cold_replay_reuses_no_chunk_even_when_chunks_fit_in_one_block() -> None:
    # Issue 11 item 9: with 0 cached tokens, chunks ending inside the first block were counted.
    requests = [
        TraceRequest(
            f"r{i}", f"question {i}",
            (make_chunk(f"tiny {i} a", id=f"a{i}"), make_chunk(f"tiny {i} b", id=f"b{i}")),
        )
        for i in range(2)
    ]
    served: list[ServedRequest] = []
    result = replay(
        requests, PlannerConfig(), HashingTokenizer(), block_size=256, on_served=served.append
    )
    assert all(s.prompt.chunk_spans[-1][1] < 256 for s in served)  # the old rule counted these
    assert [s.cached_tokens for s in served] == [0, 0]
    assert [s.reused_chunks for s in served] == [0, 0]
    assert result.chunks_reused == 0 and result.reused_chunk_fraction == 0.0


def test_warm_replay_counts_only_chunks_inside_the_cached_prefix() -> None:
    chunks = (make_chunk(TEXTS["A"], id="A"), make_chunk(TEXTS["B"], id="B"))
    requests = [TraceRequest(f"r{i}", "same question", chunks) for i in range(2)]
    served: list[ServedRequest] = []
    replay(requests, PlannerConfig(), HashingTokenizer(), block_size=BLOCK,
           on_served=served.append)
    cold, warm = served
    assert (cold.cached_tokens, cold.reused_chunks) == (0, 0)
    # the same prompt again: every full block but the one holding the last token is cached
    assert warm.cached_tokens == (warm.prompt.num_tokens - 1) // BLOCK * BLOCK
    expected = sum(1 for _, end in warm.prompt.chunk_spans if end <= warm.cached_tokens)
    assert warm.reused_chunks == expected == 2
