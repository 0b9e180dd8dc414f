"""The chunk-cache quality harness: statistics and scoring on synthetic rows, the CLI
registration, and one tiny measurement on the real embedded model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from craft_rag_bench.bench import chunk_cache_quality as ccq
from craft_rag_bench.bench.cli import NOT_IN_ALL, SUITES


def test_registered_and_not_in_all() -> None:
    assert "chunk-cache" in SUITES
    assert "chunk-cache" in NOT_IN_ALL


def test_agreement_position_by_position() -> None:
    assert ccq._agreement([1, 2, 3, 4], [1, 2, 3, 4], 4) == 1.0
    assert ccq._agreement([1, 2, 3, 4], [1, 9, 3, 4], 4) == 0.75
    assert ccq._agreement([1, 2], [1, 2], 4) == 1.0  # both stopped after 2
    assert ccq._agreement([1, 2], [1, 2, 5, 6], 4) == 0.5


def test_interval_matches_hand_computation() -> None:
    ci = ccq.interval([0.0, 0.1, -0.1, 0.2])
    assert ci["mean"] == pytest.approx(0.05)
    # sd = 0.12910, t(3) = 3.182, half = 3.182 * 0.12910 / 2
    assert ci["high"] - ci["mean"] == pytest.approx(3.182 * 0.1290994 / 2, rel=1e-4)
    assert ci["n"] == 4 and 0.0 < ci["p"] < 1.0
    assert ccq.interval([0.3])["low"] is None


class FakeScorer:
    """F1 = 1 when the answer equals the first gold, else 0; cosine likewise."""

    def score(self, answers: Sequence[str], golds: Sequence[Sequence[str]]
              ) -> list[dict[str, float]]:
        return [{"f1": float(a == g[0]), "minilm_cosine": float(a == g[0]), "em": 0.0}
                for a, g in zip(answers, golds, strict=True)]


def row(i: int, split: str, full: list[int], naive: list[int], cfo: dict[float, list[int]]
        ) -> dict[str, Any]:
    variants: list[dict[str, Any]] = [
        {"rule": "none", "fraction": 0.0, "recomputed_share": 0.0, "kl": 0.5, "top1": 0.0,
         "greedy16": 0.25, "tokens": naive}]
    variants += [{"rule": "cfo", "alpha": a, "recomputed_share": a / 2, "kl": 0.1, "top1": 1.0,
                  "greedy16": 1.0, "tokens": t} for a, t in cfo.items()]
    return {"id": f"q{i}", "dataset": "squad", "split": split, "golds": ["ok"], "tokens": 10,
            "cci": [0.7], "full_tokens": full, "variants": variants}


def test_score_curves_and_alpha_choice() -> None:
    decode = {1: "ok", 2: "bad"}.__getitem__
    rows = [row(i, "val" if i % 2 == 0 else "test", [1], [2],
                {0.2: [2] if i % 2 == 0 else [1], 0.5: [1]}) for i in range(4)]
    out = ccq.score(rows, FakeScorer(), lambda ids: decode(ids[0]))["squad"]
    assert out["full"]["f1"] == 1.0
    naive = out["curves"][0]
    assert naive["rule"] == "none" and naive["f1_diff"]["mean"] == -1.0
    assert naive["top1_agreement"] == 0.0 and naive["kl_mean"] == 0.5
    # alpha 0.2 loses F1 on the validation split, 0.5 keeps it: 0.5 is chosen, test reported.
    assert out["alpha_selected"] == 0.5
    assert out["alpha_test"]["split"] == "test" and out["alpha_test"]["f1_diff"]["mean"] == 0.0


def test_measure_tiny_prompt_on_the_model() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from craft_rag.chunkcache import load_model
    from craft_rag.paths import default_model_dir

    folder = default_model_dir()
    if not (folder / "model.safetensors").is_file():
        pytest.skip("embedded model not prepared: run `craft-rag model prepare`")
    # The thread count stays as it is: it is process-wide, and the session's shared vLLM
    # engine fails its CPU attention check (thread_num 2 vs 1) once it is changed.
    model = load_model(folder)
    ex = ccq.Example(id="t:1", dataset="squad", split="val", head=[1, 9690, 198],
                     chunks=[[504, 3458, 314, 260, 1345, 28], [9070, 216, 1073, 30, 11237, 5]],
                     tail=[339, 4713, 41], golds=["x"])
    rows = ccq.measure(model, [ex], fractions=(0.0, 1.0), rules=("cci", "random"),
                       alphas=(0.5,), max_new_tokens=3)
    (r,) = rows
    labels = [(v["rule"], v.get("fraction", v.get("alpha"))) for v in r["variants"]]
    assert labels == [("none", 0.0), ("cci", 1.0), ("random", 1.0), ("cfo", 0.5)]
    full_recompute = r["variants"][1]
    assert full_recompute["recomputed_share"] == 1.0
    assert full_recompute["kl"] < 1e-6 and full_recompute["tokens"] == r["full_tokens"]
    assert r["variants"][0]["recomputed_share"] == 0.0
