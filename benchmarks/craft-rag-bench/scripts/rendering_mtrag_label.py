"""``bench.chat_quality`` for one more rendering: the question as its own user message WITH
the ``Question: `` label, on the same MTRAG conversations, paired with the stored run.

    flock /tmp/craft_engine.lock env HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
        .venv/bin/python benchmarks/craft-rag-bench/scripts/rendering_mtrag_label.py

Serves 25 conversations x 3 turns with that rendering and ``lc_history`` (the reference, rerun:
its rows must equal the stored ones, greedy decoding, a determinism check), then paired t-tests
against the ``current``, ``question_message`` and ``lc_history`` rows of
``benchmarks/results/chat/chat_quality.json``. ~5 min on 2 cores.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import craft_rag_bench.bench.chat_quality as cq
from craft_rag.prompt import PromptFormat
from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.qa_metrics import paired_t_test

STORED = Path(__file__).resolve().parents[2] / "results" / "chat" / "chat_quality.json"
LABEL = "question_message_label"
_variant_format = cq.variant_format


def variant_format(base: PromptFormat, variant: str) -> PromptFormat:
    if variant == LABEL:
        return replace(base, question="<|im_end|>\n<|im_start|>user\nQuestion: {question}")
    return _variant_format(base, variant)


def main() -> dict[str, Any]:
    cq.variant_format = variant_format  # run_variants looks the name up in its module
    ctx = BenchContext.create(quick=False)
    started = time.perf_counter()
    result = cq.run_variants(ctx, cq.mtrag_conversations(25, 3, 5), [LABEL], max_tokens=16)
    stored = json.loads(STORED.read_text(encoding="utf-8"))["rows"]
    label, ref = result["rows"][LABEL], result["rows"]["lc_history"]
    out: dict[str, Any] = {
        "seconds": round(time.perf_counter() - started, 1),
        "lc_history_reproduced": sum(
            a.get("f1") == b.get("f1") for a, b in zip(ref, stored["lc_history"], strict=True)),
    }
    for other in ("current", "question_message", "lc_history"):
        rows = stored[other]
        idx = [i for i, r in enumerate(label) if "f1" in r and "f1" in rows[i]]
        for m in ("f1", "minilm_cosine"):
            t = paired_t_test([label[i][m] for i in idx], [rows[i][m] for i in idx])
            out[f"label_vs_{other}:{m}"] = {"diff": t.mean_difference, "p": t.p, "n": t.n}
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
