"""Suite ``chunk-cache``: answers from chunk-caches fixed by selective recomputation vs the answers
from a full prefill of the same prompt (issue 28's quality targets).

For SQuAD and HotpotQA questions the prompt is ``head + chunks + question`` in the engine's chat
format: SQuAD shows the gold paragraph and 3 paragraphs of other articles, HotpotQA its 2 gold
and 2 of its distractor paragraphs, in a seeded shuffled order. Every chunk's cache is computed
in its own context (the head only: the *independent* variant), moved to its place and fixed by
:func:`craft_rag.chunkcache.blend_prefill`. Against the full prefill we measure the first-token
KL(full || blend) and top-1 agreement, the share of the first 16 greedy tokens that agree
position by position, token F1 and the MiniLM cosine to the gold answers (the helpers of the
``quality`` suite), with paired differences (blend - full) and 95% t intervals.

Grid: recompute fractions 0 (naive reuse), 10, 20, 30, 50% for each ranker (``cci``,
``kv_deviation``, ``random``), and Cache-Craft's CFO count (``cci`` ranking) for several alphas.
Questions alternate between a validation and a test split; alpha is the one with the lowest
mean recompute share whose validation F1 is within ``F1_SLACK`` of the full prefill's
(Cache-Craft Eq. 13), reported on the test split.

Three stages, so the model can run on another machine: ``prepare`` (token ids, needs the
datasets and the tokenizer), ``measure`` (needs only torch, transformers, the model folder and
:mod:`craft_rag.chunkcache`), ``score`` (F1, MiniLM, statistics). ``run(ctx)`` does all three in
process. Command line:
``python -m craft_rag_bench.bench.chunk_cache_quality prepare|measure|score``.

``--json`` layout (``results`` of the suite): ``{"suite": "chunk-cache", "model", "device",
"n_per_dataset", "fractions", "rules", "alphas", "seconds", "datasets": {name: {"full":
{"f1", "minilm_cosine"}, "curves": [{"rule", "fraction", "recomputed_share", "kl_mean",
"top1_agreement", "greedy16_agreement", "f1_diff": CI, "minilm_diff": CI}], "cfo": [{"alpha",
"split", ...same metrics}], "alpha_selected", "alpha_test": {...}}}}`` where
``CI = {"mean", "low", "high", "n", "p"}``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from craft_rag_bench.bench.context import BenchContext

FRACTIONS: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.5)
RULES: tuple[str, ...] = ("cci", "kv_deviation", "random")
ALPHAS: tuple[float, ...] = (0.1, 0.2, 0.35, 0.5, 0.75, 1.0)
GREEDY_TOKENS = 16
F1_SLACK = 0.01
"""Alpha is chosen so the validation F1 stays within this (1 F1 point) of the full prefill."""
DATASETS: tuple[str, ...] = ("squad", "hotpotqa")
DISTRACTORS = 2
"""HotpotQA: distractor paragraphs shown beside the 2 gold ones; SQuAD shows 3 (one gold)."""


@dataclass(frozen=True, slots=True)
class Example:
    """One prompt as token ids: ``head + chunks + tail``; ``split`` is ``val`` or ``test``."""

    id: str
    dataset: str
    split: str
    head: list[int]
    chunks: list[list[int]]
    tail: list[int]
    golds: list[str]


# --------------------------------------------------------------------------- prepare


def prepare(datasets: Sequence[str], n: int, seed: int = 0,
            max_chunk_tokens: int | None = None) -> list[Example]:
    """The first ``n`` usable questions of each dataset as token-exact prompts; with
    ``max_chunk_tokens`` each chunk is cut to that many tokens (the quick size only). Cost:
    loading the datasets and tokenizing ``n x 4`` paragraphs."""
    from craft_rag.chunk import make_chunk
    from craft_rag.engine.chat_format import derive_chat_format
    from craft_rag.paths import default_model_dir
    from craft_rag.prompt import PromptAssembler
    from craft_rag.tokenizer import load_tokenizer
    from craft_rag_bench.datasets import load_dataset

    folder = default_model_dir()
    assembler = PromptAssembler(load_tokenizer(folder, fallback=False),
                                derive_chat_format(folder))
    rng = random.Random(seed)
    out: list[Example] = []
    for name in datasets:
        data = load_dataset(name)
        passages = data.passage_map()
        pool = list(data.passages)
        seen_gold: set[str] = set()
        count = 0
        for q in data.questions:
            if count >= n:
                break
            gold = [passages[p] for p in q.gold_passage_ids if p in passages]
            if not gold or (name == "squad" and gold[0].id in seen_gold):
                continue  # SQuAD: one question per paragraph, so examples are independent
            seen_gold.update(p.id for p in gold)
            if name == "hotpotqa":
                others = [passages[p] for p in q.passage_ids
                          if p in passages and p not in q.gold_passage_ids]
                shown = gold[:2] + rng.sample(others, min(DISTRACTORS, len(others)))
            else:
                others = [p for p in rng.sample(pool, 8) if p.title != gold[0].title][:3]
                shown = gold[:1] + others
            rng.shuffle(shown)
            chunks = [make_chunk(p.content) for p in shown]
            out.append(Example(
                id=f"{name}:{q.id}", dataset=name, split="val" if count % 2 == 0 else "test",
                head=list(assembler.head_ids),
                chunks=[list(assembler.chunk_ids(c))[:max_chunk_tokens] for c in chunks],
                tail=list(assembler.question_ids(q.question)), golds=list(q.answers)))
            count += 1
    return out


# --------------------------------------------------------------------------- measure


def _kl(ref_logits: Any, logits: Any) -> float:
    import torch

    p = torch.log_softmax(ref_logits.double(), dim=-1)
    q = torch.log_softmax(logits.double(), dim=-1)
    return float((p.exp() * (p - q)).sum())


def _agreement(ref: Sequence[int], other: Sequence[int], length: int = GREEDY_TOKENS) -> float:
    """Share of positions ``< length`` where both sequences hold the same token (a missing
    token, after an early stop, disagrees unless both stopped)."""
    agree = sum(1 for i in range(length)
                if (ref[i] if i < len(ref) else None) == (other[i] if i < len(other) else None))
    return agree / length


def measure(
    model: Any,
    examples: Sequence[Example],
    *,
    fractions: Sequence[float] = FRACTIONS,
    rules: Sequence[str] = RULES,
    alphas: Sequence[float] = ALPHAS,
    max_new_tokens: int = GREEDY_TOKENS,
    eos_ids: frozenset[int] = frozenset(),
    progress: bool = False,
) -> list[dict[str, Any]]:
    """One row per example: the full prefill's greedy tokens and, per variant, its tokens,
    KL, top-1 agreement, greedy agreement and recompute share. Cost per example: one full
    prefill, one prefill per chunk, one blend per (rule, fraction > 0) and alpha, and
    ``max_new_tokens`` decode steps for each."""
    import torch

    from craft_rag.chunkcache import (
        RankInput,
        assemble,
        blend_prefill,
        compute_chunk_kv,
        continue_greedy_batch,
        full_prefill,
        select_tokens,
    )

    rows: list[dict[str, Any]] = []
    for ei, ex in enumerate(examples):
        t0 = time.perf_counter()
        ids = ex.head + [t for c in ex.chunks for t in c]
        head_kv = full_prefill(model, ex.head)
        caches = [compute_chunk_kv(model, ex.head, c, model_id="embedded") for c in ex.chunks]
        naive = assemble(model, ex.head, head_kv, caches)
        inp = RankInput(model, naive.kv, tuple(caches), naive.spans, seed=ei)
        total = sum(len(c) for c in ex.chunks)
        labels: list[dict[str, Any]] = []
        spans = [full_prefill(model, ids)]
        with torch.no_grad():
            plan = [({"rule": rule if f > 0 else "none", "fraction": f}, rule, {"fraction": f})
                    for rule in rules for f in fractions if f > 0.0 or rule == rules[0]]
            plan += [({"rule": "cfo", "alpha": a}, "cci", {"alpha": a}) for a in alphas]
            for label, rule, how in plan:
                out = blend_prefill(model, ex.head, head_kv, caches,
                                    select_tokens(rule, inp, **how))
                labels.append({**label, "recomputed_share": out.recomputed / total})
                spans.append(out.kv)
        # One batch for the reference and every variant: the same kernels decode them all.
        ref, *conts = continue_greedy_batch(model, spans, ex.tail, max_new_tokens,
                                            eos_ids=eos_ids)
        variants = [{
            **label, "kl": _kl(ref.first_logits, cont.first_logits),
            "top1": float(int(ref.first_logits.argmax()) == int(cont.first_logits.argmax())),
            "greedy16": _agreement(ref.tokens, cont.tokens, max_new_tokens),
            "tokens": list(cont.tokens)} for label, cont in zip(labels, conts, strict=True)]
        rows.append({"id": ex.id, "dataset": ex.dataset, "split": ex.split, "golds": ex.golds,
                     "tokens": total + len(ex.head) + len(ex.tail),
                     "cci": [c.cci for c in caches], "full_tokens": list(ref.tokens),
                     "variants": variants, "seconds": time.perf_counter() - t0})
        if progress:
            print(f"[chunk-cache] {ei + 1}/{len(examples)} {ex.id} "
                  f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    return rows


# --------------------------------------------------------------------------- score


def interval(diffs: Sequence[float]) -> dict[str, Any]:
    """Mean of paired differences with a 95% Student-t interval and the paired t-test's p."""
    from craft_rag_bench.bench.qa_metrics import paired_t_test

    n = len(diffs)
    mean = statistics.fmean(diffs) if diffs else 0.0
    if n < 2:
        return {"mean": mean, "low": None, "high": None, "n": n, "p": None}
    sd = statistics.stdev(diffs)
    half = _t975(n - 1) * sd / math.sqrt(n)
    p = paired_t_test(list(diffs), [0.0] * n).p
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n, "p": p}


def _t975(df: int) -> float:
    """97.5% quantile of Student's t (table for small df, normal approximation beyond)."""
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
             9: 2.262, 10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042, 40: 2.021, 60: 2.000}
    if df in table:
        return table[df]
    below = [d for d in table if d < df]
    if not below or df > 60:
        return 1.96 + 2.4 / df if df > 60 else 12.706
    return table[max(below)]  # conservative: the next smaller df's (wider) quantile


def _summary(rows: Sequence[dict[str, Any]], pick: Any, full: dict[str, list[float]],
             scores: dict[tuple[str, int], dict[str, float]]) -> dict[str, Any]:
    chosen = [(r, v, i) for r in rows for i, v in enumerate(r["variants"]) if pick(v)]
    f1d = [scores[(r["id"], i)]["f1"] - full["f1"][rows.index(r)] for r, _, i in chosen]
    md = [scores[(r["id"], i)]["minilm_cosine"] - full["minilm_cosine"][rows.index(r)]
          for r, _, i in chosen]
    vs = [v for _, v, _ in chosen]
    return {
        "n": len(vs),
        "recomputed_share": statistics.fmean(v["recomputed_share"] for v in vs) if vs else None,
        "kl_mean": statistics.fmean(v["kl"] for v in vs) if vs else None,
        "top1_agreement": statistics.fmean(v["top1"] for v in vs) if vs else None,
        "greedy16_agreement": statistics.fmean(v["greedy16"] for v in vs) if vs else None,
        "f1_diff": interval(f1d), "minilm_diff": interval(md),
    }


def score(rows: Sequence[dict[str, Any]], scorer: Any, decode: Any) -> dict[str, Any]:
    """F1 / MiniLM per answer and the per-dataset summary (see the module docstring).
    ``scorer`` is :class:`craft_rag_bench.bench.quality.Scorer`; ``decode`` maps ids to text."""
    out: dict[str, Any] = {}
    for name in sorted({r["dataset"] for r in rows}):
        sub = [r for r in rows if r["dataset"] == name]
        full_s = scorer.score([decode(r["full_tokens"]).strip() for r in sub],
                              [r["golds"] for r in sub])
        full = {m: [s[m] for s in full_s] for m in ("f1", "minilm_cosine")}
        scores: dict[tuple[str, int], dict[str, float]] = {}
        answers = [(r, i, decode(v["tokens"]).strip()) for r in sub
                   for i, v in enumerate(r["variants"])]
        flat = scorer.score([a for _, _, a in answers], [r["golds"] for r, _, _ in answers])
        for (r, i, _), s in zip(answers, flat, strict=True):
            scores[(r["id"], i)] = s
        curves = []
        for v in sub[0]["variants"]:
            if v["rule"] == "cfo":
                continue
            key = (v["rule"], v["fraction"])
            curves.append({"rule": v["rule"], "fraction": v["fraction"], **_summary(
                sub, lambda x, k=key: (x["rule"], x.get("fraction")) == k, full, scores)})
        cfo_rows = []
        for a in sorted({v["alpha"] for v in sub[0]["variants"] if v["rule"] == "cfo"}):
            for split in ("val", "test"):
                part = [r for r in sub if r["split"] == split]
                idx = [sub.index(r) for r in part]
                pf = {m: [full[m][i] for i in idx] for m in full}
                cfo_rows.append({"alpha": a, "split": split, **_summary(
                    part, lambda x, a=a: x["rule"] == "cfo" and x["alpha"] == a, pf, scores)})
        ok = [c for c in cfo_rows if c["split"] == "val" and c["n"]
              and c["f1_diff"]["mean"] >= -F1_SLACK]
        best = min(ok, key=lambda c: c["recomputed_share"])["alpha"] if ok else max(
            (c["alpha"] for c in cfo_rows), default=None)
        out[name] = {
            "n": len(sub),
            "full": {m: statistics.fmean(v) for m, v in full.items()},
            "mean_prompt_tokens": statistics.fmean(r["tokens"] for r in sub),
            "mean_cci": statistics.fmean(c for r in sub for c in r["cci"]),
            "curves": curves, "cfo": cfo_rows, "alpha_selected": best,
            "alpha_test": next((c for c in cfo_rows if c["alpha"] == best
                                and c["split"] == "test"), None),
        }
    return out


class UniqueTextScorer:
    """The ``quality`` suite's scores (SQuAD EM, token F1, best MiniLM cosine over the golds)
    with each distinct text embedded once: the 19 variants of a prompt mostly give the same
    answer, and the golds repeat for every variant (12k texts -> about 2k here)."""

    def __init__(self, embedder: Any) -> None:
        self._embedder = embedder

    def score(self, answers: Sequence[str], golds: Sequence[Sequence[str]]
              ) -> list[dict[str, float]]:
        from craft_rag_bench.bench.qa_metrics import exact_match, token_f1

        texts = sorted({*answers, *(g for gs in golds for g in gs)})
        vectors = self._embedder.encode(texts)
        row = {t: i for i, t in enumerate(texts)}
        return [{"em": exact_match(a, gs), "f1": token_f1(a, gs),
                 "minilm_cosine": max((float(vectors[row[a]] @ vectors[row[g]]) for g in gs),
                                      default=0.0)}
                for a, gs in zip(answers, golds, strict=True)]


# --------------------------------------------------------------------------- suite


def run(ctx: BenchContext) -> dict[str, Any]:
    """All three stages in this process on the CPU. Quick: 1 question per dataset with chunks
    cut to 32 tokens, fractions 0 and 0.3, one alpha, 4 greedy tokens."""
    import torch

    from craft_rag.chunkcache import load_model
    from craft_rag.engine.model import generation_eos_ids
    from craft_rag.paths import default_model_dir
    from craft_rag.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    n = 1 if ctx.quick else 100
    fractions = (0.0, 0.3) if ctx.quick else FRACTIONS
    alphas = (0.5,) if ctx.quick else ALPHAS
    max_new = 4 if ctx.quick else GREEDY_TOKENS
    examples = prepare(DATASETS, n, ctx.seed, max_chunk_tokens=32 if ctx.quick else None)
    folder = default_model_dir()
    # One thread (several thrash on a shared 2-core machine), restored afterwards: the count is
    # process-wide, and an in-process vLLM engine fails its CPU attention check once it changed.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = measure(load_model(folder), examples, fractions=fractions, alphas=alphas,
                       max_new_tokens=max_new, eos_ids=generation_eos_ids(folder),
                       progress=ctx.progress)
    finally:
        torch.set_num_threads(threads)
    tok = load_tokenizer(folder, fallback=False)
    results = score(rows, UniqueTextScorer(ctx.embedder()), tok.decode)  # type: ignore[attr-defined]
    return {"suite": "chunk-cache", "model": folder.name, "device": str(torch.device("cpu")),
            "n_per_dataset": n, "fractions": list(fractions), "rules": list(RULES),
            "alphas": list(alphas), "greedy_tokens": max_new,
            "seconds": time.perf_counter() - t0, "datasets": results}


def main(argv: Sequence[str] | None = None) -> None:
    """``prepare --n N --out ex.json`` | ``measure --examples ex.json --model DIR --out raw.json
    [--device cuda]`` | ``score --raw raw.json --out results.json``."""
    p = argparse.ArgumentParser(prog="chunk_cache_quality")
    p.add_argument("stage", choices=["prepare", "measure", "score"])
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--examples", type=Path)
    p.add_argument("--raw", type=Path)
    p.add_argument("--model", type=Path)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.stage == "prepare":
        exs = prepare(DATASETS, args.n)
        args.out.write_text(json.dumps([asdict(e) for e in exs]))
    elif args.stage == "measure":
        from craft_rag.chunkcache import load_model

        model = load_model(args.model).to(args.device)
        exs = [Example(**e) for e in json.loads(args.examples.read_text())]
        eos = _eos(args.model)
        t0 = time.perf_counter()
        rows = measure(model, exs, eos_ids=eos, progress=True)
        args.out.write_text(json.dumps({"device": args.device, "rows": rows,
                                        "seconds": time.perf_counter() - t0}))
    else:
        from craft_rag.paths import default_model_dir
        from craft_rag.tokenizer import load_tokenizer
        from craft_rag_bench.bench.context import BenchContext

        raw = json.loads(args.raw.read_text())
        tok = load_tokenizer(default_model_dir(), fallback=False)
        n = max(sum(1 for r in raw["rows"] if r["dataset"] == d) for d in DATASETS)
        result = {"suite": "chunk-cache", "model": default_model_dir().name,
                  "device": raw["device"], "n_per_dataset": n, "fractions": list(FRACTIONS),
                  "rules": list(RULES), "alphas": list(ALPHAS), "greedy_tokens": GREEDY_TOKENS,
                  "seconds": raw["seconds"],
                  "datasets": score(raw["rows"], UniqueTextScorer(BenchContext().embedder()),
                                    tok.decode)}  # type: ignore[attr-defined]
        args.out.write_text(json.dumps(result, indent=1))


def _eos(folder: Path) -> frozenset[int]:
    """EOS ids from ``generation_config.json`` (int or list), without the engine package."""
    raw = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id", [])
    return frozenset([raw] if isinstance(raw, int) else [int(t) for t in raw])


if __name__ == "__main__":
    main()
