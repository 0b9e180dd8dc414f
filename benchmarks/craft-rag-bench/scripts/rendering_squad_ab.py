"""Paired A/B of the prompt rendering on the ``bench quality`` SQuAD questions (one engine).

    flock /tmp/craft_engine.lock env HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
        .venv/bin/python benchmarks/craft-rag-bench/scripts/rendering_squad_ab.py 40 4

The first N single-turn SQuAD questions of the quality suite, each in the retriever order plus
P seeded permutations; every variant assembled by three formats (``question_message``: the
default, the question as its own user message; ``old``: ``question_message=False``;
``question_message_label``: own message with ``Question: ``) and served by the same engine
through ``generate_tokens`` (greedy, the suite's ``max_tokens``). Prints JSON: mean F1 / MiniLM
and paired t-tests against ``old`` on the retriever order and on each question's mean over its
orders. Takes ~4 min for 40 x 5 on 2 cores.
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

from craft_rag.engine import SamplingRequest
from craft_rag.engine.chat_format import derive_chat_format
from craft_rag.engine.results import TokensRequest
from craft_rag.paths import default_model_dir
from craft_rag.prompt import PromptAssembler
from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.qa_metrics import paired_t_test
from craft_rag_bench.bench.quality import Scorer, gold_answers

METRICS = ("f1", "minilm_cosine")


def main(n: int, permutations: int) -> dict[str, Any]:
    ctx = BenchContext.create(quick=False)
    workload = ctx.workloads(["squad"])[0]
    trace = ctx.trace(workload, max(4 * n, 40))
    firsts = [r for r in trace if "#" not in r.id and r.conversation_id is None]
    picked = (firsts or [r for r in trace if r.conversation_id is None])[:n]
    golds = gold_answers(workload, trace)
    engine = ctx.get_engine()
    model = default_model_dir()
    formats = {
        "question_message": derive_chat_format(model),
        "old": derive_chat_format(model, question_message=False),
        "question_message_label": derive_chat_format(model, question="Question: {question}"),
    }
    assemblers = {k: PromptAssembler(ctx.tokenizer(), f) for k, f in formats.items()}
    scorer = Scorer(ctx)
    rng = random.Random(ctx.seed)
    first: dict[str, dict[str, list[float]]] = {k: {m: [] for m in METRICS} for k in formats}
    mean: dict[str, dict[str, list[float]]] = {k: {m: [] for m in METRICS} for k in formats}
    started = time.perf_counter()
    for request in picked:
        variants = [list(request.chunks)]
        for _ in range(permutations):
            perm = list(request.chunks)
            rng.shuffle(perm)
            variants.append(perm)
        gold = golds.get(request.id, (request.answer or "",))
        for name, assembler in assemblers.items():
            sampling = SamplingRequest(max_tokens=ctx.sizes.quality_max_tokens)
            handles = [
                engine.submit(TokensRequest(
                    assembler.single_turn(v, request.query).token_ids, None, sampling))
                for v in variants
            ]
            texts = [h.result().text.strip() for h in handles]
            scores = scorer.score(texts, [gold] * len(texts))
            for m in METRICS:
                values = [s[m] for s in scores]
                first[name][m].append(values[0])
                mean[name][m].append(sum(values) / len(values))
    out: dict[str, Any] = {"questions": len(picked), "permutations": permutations,
                           "seconds": round(time.perf_counter() - started, 1)}
    for view, data in (("retriever_order", first), ("mean_over_orders", mean)):
        for m in METRICS:
            old = data["old"][m]
            for name in ("question_message", "question_message_label"):
                new = data[name][m]
                t = paired_t_test(new, old)
                out[f"{view}:{m}:{name}_vs_old"] = {
                    "new": sum(new) / len(new), "old": sum(old) / len(old),
                    "diff": t.mean_difference, "p": t.p, "n": t.n,
                }
    return out


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]] or [20, 10]
    print(json.dumps(main(*args), indent=1))
