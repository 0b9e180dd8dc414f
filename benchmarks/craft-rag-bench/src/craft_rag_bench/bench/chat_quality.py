"""Answer quality of CRAFT chat under prompt-rendering variants (issue 15 item 3, quality).

``python -m craft_rag_bench.bench.chat_quality --conversations 20 --out DIR`` (starts the
embedded engine once per variant, one at a time: run it under the engine lock). Every variant
keeps what makes CRAFT's prompts reusable: ``[head][chunks][question]`` with the chunks before
the question and the same pieces every turn (append-only), so KV reuse is unchanged; only the
text around the chunks and the question differs:

* ``current``: the single-turn rendering
  (``derive_chat_format(..., question_message=False)``): one user message
  ``instructions + "Document: ..."* + "Question: q"``; the engine's only rendering before
  it chose per path;
* ``question_message``: the same, but the question is its own user message after the one
  holding the documents (what the frameworks send: context, then the human message); what
  the engine's conversations use by default (:func:`craft_rag.engine.wiring.conversation_format`);
* ``context_system``: the frameworks' turn-1 layout: the instructions and documents in the
  system message (``Context:`` then the passages), the question as the user message;
* ``instructions_after``: the instruction repeated right before the question
  (``Answer ... using the documents above. Be brief. Question: q``);
* ``default``: the engine as users get it (no ``prompt_format``): conversation turns render
  with the question as its own user message where the template allows it, single requests
  the single-turn way (``engine.chat_rendering`` is recorded in the JSON).

The pieces are written for ChatML templates (the embedded SmolLM2); another template would
need them derived like :func:`~craft_rag.engine.chat_format.format_from_pieces` does.
LangChain ``RunnableWithMessageHistory`` (the best framework baseline of ``bench chat``) runs
once as the reference (its prompt does not depend on CRAFT's format). Same passages per turn,
greedy decoding, ``max_tokens`` new tokens; token F1 and MiniLM cosine against the reference
answers; paired t-tests on the same turns.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from craft_rag.engine.chat_format import NO_DOCUMENTS
from craft_rag_bench.bench.chat import (
    ChatConversation,
    _score,
    _serve,
    _systems,
    mtrag_conversations,
)
from craft_rag_bench.bench.qa_metrics import paired_t_test

if TYPE_CHECKING:
    from craft_rag.prompt import PromptFormat
    from craft_rag_bench.bench.context import BenchContext

VARIANTS = ("current", "question_message", "context_system", "instructions_after")
"""Variants given to the engine as its ``prompt_format`` (every request renders with it)."""
ENGINE_DEFAULT = "default"
"""The engine's own per-path choice (no ``prompt_format``)."""
CHOICES = (ENGINE_DEFAULT, *VARIANTS)
IM_END, IM_START = "<|im_end|>", "<|im_start|>"


def variant_format(base: PromptFormat, variant: str) -> PromptFormat:
    """``base`` (the engine's ChatML-derived format) rendered as ``variant``. ``ValueError``
    for an unknown variant or a base that is not ChatML."""
    if variant not in VARIANTS:
        msg = f"variant must be one of {VARIANTS}, got {variant!r}"
        raise ValueError(msg)
    user_open = f"{IM_START}user\n"
    if user_open not in base.head or IM_END not in base.tail:
        msg = "variant_format needs a ChatML prompt format (<|im_start|>user ... <|im_end|>)"
        raise ValueError(msg)
    new_user = f"{IM_END}\n{user_open}"
    if variant == "current":  # the rendering before question messages became the default
        return replace(base, question="Question: {question}", no_documents="")
    if variant == "question_message":
        return replace(base, question=new_user + "{question}", no_documents=NO_DOCUMENTS)
    if variant == "context_system":
        return replace(
            base,
            head=f"{IM_START}system\nAnswer the question using the context.\n\nContext:\n",
            chunk="{text}\n\n",
            question=new_user + "{question}",
            no_documents=NO_DOCUMENTS,
        )
    return replace(
        base,
        question="Answer the question using the documents above. Be brief.\n"
        "Question: {question}",
        no_documents="",
    )


def compare(runs: dict[str, list[dict[str, Any]]], reference: str) -> dict[str, Any]:
    """Per system: mean F1/MiniLM; paired (system - ``reference``) differences. Rows of all
    systems must be the same turns in the same order."""
    out: dict[str, Any] = {}
    ref = runs[reference]
    for name, rows in runs.items():
        idx = [i for i, r in enumerate(rows) if "f1" in r]
        entry: dict[str, Any] = {"turns": len(idx)}
        for metric in ("f1", "minilm_cosine"):
            entry[metric] = sum(rows[i][metric] for i in idx) / len(idx) if idx else None
            if name != reference and idx:
                t = paired_t_test([rows[i][metric] for i in idx], [ref[i][metric] for i in idx])
                entry[f"{metric}_vs_{reference}"] = {
                    "mean_diff": t.mean_difference, "p": t.p, "n": t.n
                }
        out[name] = entry
    return out


def run_variants(
    ctx: BenchContext,
    conversations: Sequence[ChatConversation],
    variants: Sequence[str] = VARIANTS,
    *,
    max_tokens: int = 16,
    reference: str = "lc_history",
) -> dict[str, Any]:
    """Serve every conversation with CRAFT chat under each variant (a fresh engine per
    variant, closed after; ``default``: the engine's own formats) and once with
    ``reference``; score and compare."""
    from craft_rag.engine import CraftEngine, EngineSettings
    from craft_rag.planner import CraftPlanner, PlannerConfig

    runs: dict[str, list[dict[str, Any]]] = {}
    renderings: dict[str, str] = {}
    for k, variant in enumerate(variants):
        probe = ctx.prompt_format()
        if probe is None:
            msg = "the embedded model's tokenizer is not prepared (craft-rag model prepare)"
            raise RuntimeError(msg)
        fmt = None if variant == ENGINE_DEFAULT else variant_format(probe, variant)
        engine = CraftEngine(
            EngineSettings(block_size=ctx.block_size, max_model_len=ctx.max_model_len),
            prompt_format=fmt,
        )
        renderings[variant] = engine.chat_rendering
        try:
            engine.set_planner(CraftPlanner(PlannerConfig(policy="tree")))
            systems = _systems(engine, max_tokens)
            names = [("craft", variant)]
            if k == 0:
                names.append((reference, reference))
            for system, label in names:
                rows: list[dict[str, Any]] = []
                for conv in ctx.bar(list(conversations), f"{label}"):
                    rows.extend(_serve(engine, systems[system], conv, system))
                    engine.end_conversation(f"{system}:{conv.id}")
                runs[label] = rows
        finally:
            engine.close()
    for rows in runs.values():
        _score(ctx, rows)
    return {"max_tokens": max_tokens, "reference": reference, "chat_rendering": renderings,
            "summary": compare(runs, reference), "rows": runs}


def main(argv: Sequence[str] | None = None) -> None:
    from craft_rag.files import write_atomic
    from craft_rag_bench.bench.context import BenchContext

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--variants", default=",".join(CHOICES))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    variants = list(dict.fromkeys(v for v in args.variants.split(",") if v))  # once each
    if not variants:
        p.error(f"--variants: name at least one of {','.join(CHOICES)}")
    for v in variants:
        if v not in CHOICES:
            p.error(f"--variants: unknown {v!r}; choose from {','.join(CHOICES)}")
    ctx = BenchContext.create(quick=False)
    convs = mtrag_conversations(args.conversations, args.turns, args.top_k)
    started = time.perf_counter()
    result = run_variants(ctx, convs, variants, max_tokens=args.max_tokens)
    result.update(conversations=len(convs), turns=sum(len(c.turns) for c in convs),
                  seconds=round(time.perf_counter() - started, 1))
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "chat_quality.json", json.dumps(result, indent=1))
    for name, entry in result["summary"].items():
        print(name, json.dumps(entry), file=sys.stderr)


if __name__ == "__main__":
    main()
