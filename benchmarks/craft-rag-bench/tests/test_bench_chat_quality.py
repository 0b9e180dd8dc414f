"""``craft_rag_bench.bench.chat_quality``: the prompt variants (pieces only; the real-engine
run is the module's CLI, documented in docs/benchmarks.md) and the paired comparison."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from craft_rag.prompt import PromptFormat
from craft_rag_bench.bench.chat_quality import CHOICES, VARIANTS, compare, main, variant_format

CHATML = PromptFormat(
    head="<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nAnswer briefly.\n\n",
    chunk="Document: {text}\n\n",
    question="Question: {question}",
    tail="<|im_end|>\n<|im_start|>assistant\n",
    answer="{answer}<|im_end|>\n<|im_start|>user\n",
)


def render(fmt: PromptFormat, chunks: list[str], question: str) -> str:
    return (fmt.head + "".join(fmt.chunk.format(text=c) for c in chunks)
            + fmt.question.format(question=question) + fmt.tail)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_keeps_chunks_before_the_question_and_the_reply_piece(
    variant: str,
) -> None:
    fmt = variant_format(CHATML, variant)
    text = render(fmt, ["ALPHA", "BETA"], "QUESTION?")
    assert text.index("ALPHA") < text.index("BETA") < text.index("QUESTION?")
    assert text.endswith("<|im_start|>assistant\n")
    assert fmt.answer == CHATML.answer and fmt.tail == CHATML.tail  # turns still append


def test_question_message_closes_the_documents_message() -> None:
    text = render(variant_format(CHATML, "question_message"), ["ALPHA"], "Q?")
    assert "ALPHA\n\n<|im_end|>\n<|im_start|>user\nQ?<|im_end|>" in text
    system = render(variant_format(CHATML, "context_system"), ["ALPHA"], "Q?")
    assert system.startswith("<|im_start|>system\nAnswer the question using the context.")
    assert "Context:\nALPHA\n\n<|im_end|>\n<|im_start|>user\nQ?" in system
    assert variant_format(CHATML, "current") == CHATML


def test_unknown_variant_or_non_chatml_format_is_refused() -> None:
    with pytest.raises(ValueError, match="variant must be one of"):
        variant_format(CHATML, "nope")
    with pytest.raises(ValueError, match="ChatML"):
        variant_format(PromptFormat(), "question_message")


def rows(f1s: list[float]) -> list[dict[str, Any]]:
    return [{"turn": i + 1, "f1": f, "minilm_cosine": f / 2} for i, f in enumerate(f1s)]


def test_compare_pairs_each_system_with_the_reference() -> None:
    out = compare({"ref": rows([0.1, 0.2, 0.3]), "a": rows([0.2, 0.4, 0.4])}, "ref")
    assert out["ref"]["f1"] == pytest.approx(0.2)
    assert "f1_vs_ref" not in out["ref"]
    diff = out["a"]["f1_vs_ref"]
    assert diff["mean_diff"] == pytest.approx(0.4 / 3)
    assert diff["n"] == 3 and 0 < diff["p"] < 1
    assert out["a"]["minilm_cosine_vs_ref"]["mean_diff"] == pytest.approx(0.2 / 3)


def test_current_is_the_old_rendering_whatever_the_engine_default(model_dir: Path) -> None:
    """``current`` is the rendering measured as "current" (question closing the documents'
    message, the engine default) whichever format it starts from."""
    from craft_rag.engine.chat_format import derive_chat_format

    new = derive_chat_format(model_dir, question_message=True)
    old = derive_chat_format(model_dir)
    assert variant_format(new, "current") == old
    assert variant_format(old, "question_message") == new


def test_default_is_a_variants_choice_but_not_a_format(tmp_path: Path) -> None:
    """``default`` (the engine's own per-path formats) is accepted by ``--variants`` and is
    no prompt format of its own; unknown names are usage errors before anything is served."""
    assert CHOICES[0] == "default" and set(CHOICES[1:]) == set(VARIANTS)
    with pytest.raises(ValueError, match="variant must be one of"):
        variant_format(CHATML, "default")
    with pytest.raises(SystemExit):
        main(["--variants", "default,nope", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())
