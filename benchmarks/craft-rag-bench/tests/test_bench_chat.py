"""``craft-rag bench chat``: the summary statistics (synthetic rows, no engine) and one quick
run of the whole suite on the shared engine (engine-marked)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from craft_rag_bench.bench.chat import QUICK, markdown, summarize

if TYPE_CHECKING:
    from craft_rag.engine import CraftEngine


def rows(ttfts: list[float], f1: float) -> list[dict[str, Any]]:
    return [
        {"turn": i + 1, "ttft_ms": t, "ttft_cpu_ms": 2 * t, "computed_tokens": 10 * (i + 1),
         "prompt_tokens": 100,
         "f1": f1, "minilm_cosine": f1, "requests": 1}
        for i, t in enumerate(ttfts)
    ]


def test_summary_compares_craft_with_the_fastest_baseline_on_turns_after_the_first() -> None:
    runs = {
        "craft": rows([900, 100, 110, 90], 0.5),
        "li_context": rows([100, 300, 330, 270], 0.5),
        "lc_history": rows([100, 200, 220, 180], 0.4),
        "li_condense_plus": rows([100, 600, 660, 540], 0.5),
    }
    out = summarize(runs)
    craft = out["systems"]["craft"]
    assert craft["mean_ttft_ms"] == pytest.approx(100.0)  # turn 1 (900 ms) is not counted
    assert craft["mean_ttft_ms_turn1"] == pytest.approx(900.0)
    assert craft["p99_ttft_ms"] == pytest.approx(110.0)
    assert craft["mean_computed_tokens"] == pytest.approx(30.0)
    assert craft["mean_ttft_cpu_ms"] == pytest.approx(200.0)
    vs = out["vs_best"]
    assert vs["best_baseline"] == "lc_history"
    assert vs["speedup_mean_ttft_turns_ge2"] == pytest.approx(2.0)
    assert vs["target_1_3x_met"] is True
    assert vs["speedup_mean_ttft_cpu_turns_ge2"] == pytest.approx(2.0)
    assert vs["ttft_paired"]["n"] == 3 and vs["ttft_paired"]["mean_diff_ms"] == pytest.approx(100)
    quality = vs["quality_paired_craft_minus_baseline"]
    assert quality["lc_history:f1"]["mean_diff"] == pytest.approx(0.1)
    assert quality["li_context:f1"]["mean_diff"] == pytest.approx(0.0)


def test_summary_without_craft_or_baselines_has_no_comparison() -> None:
    assert "vs_best" not in summarize({"li_context": rows([1, 2], 0.0)})
    assert "vs_best" not in summarize({"craft": rows([1, 2], 0.0)})


@pytest.mark.engine
def test_chat_suite_quick_on_the_shared_engine(tmp_path: Path, craft_engine: CraftEngine) -> None:
    pytest.importorskip("llama_index.core")
    pytest.importorskip("langchain_core")
    from craft_rag_bench.bench.cli import run_suites
    from craft_rag_bench.bench.context import BenchContext

    ctx = BenchContext.create(quick=True, progress=False, engine=craft_engine)
    try:
        results = run_suites(ctx, ["chat"], tmp_path / "results", plots=True)
    except FileNotFoundError as exc:  # shared/data missing
        pytest.skip(str(exc))
    finally:
        ctx.close()
    chat = results["chat"]
    assert (tmp_path / "results" / "chat.json").is_file()
    assert (tmp_path / "results" / "chat.png").is_file()
    assert [r["cached"] for r in chat["ttft_grid"]] == [0, 256]
    for workload in ("mtrag", "hotpotqa"):
        w = chat["workloads"][workload]
        assert set(w["systems"]) == set(QUICK.systems)
        for system, served in w["rows"].items():
            assert len(served) == w["turns"], system
            for row in served:
                assert 0 <= row["computed_tokens"] <= row["prompt_tokens"]
                assert row["ttft_ms"] > 0 and row["requests"] >= 1
        # CRAFT's later turns continue the conversation: fewer computed than prompt tokens.
        later = [r for r in w["rows"]["craft"] if r["turn"] >= 2]
        assert all(r["computed_tokens"] < r["prompt_tokens"] for r in later)
        # CondensePlusContext makes two engine requests on later turns (condense, answer).
        assert all(r["requests"] == 2 for r in w["rows"]["li_condense_plus"] if r["turn"] >= 2)
    assert "vs_best" in chat["workloads"]["mtrag"]
    assert markdown(chat)[0].startswith("| cached |")
