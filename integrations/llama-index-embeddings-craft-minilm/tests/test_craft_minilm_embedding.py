"""llama_index.embeddings.craft_minilm: the packaged MiniLM folder as a LlamaIndex embed model
(offline; the folder comes from the core's packaged_embedding_model_dir, not the harness)."""

from __future__ import annotations

import math

import pytest
from llama_index.embeddings.craft_minilm import (
    INSTALL_HINT,
    craft_minilm_embedding,
    minilm_model_dir,
)

from craft_rag import packaged_embedding_model_dir


def _model_or_skip() -> str:
    try:
        return minilm_model_dir()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def test_the_folder_is_the_core_one() -> None:
    assert _model_or_skip() == str(packaged_embedding_model_dir())


@pytest.mark.retrieval
def test_embeddings_are_384_dimensional_and_match_for_equal_text() -> None:
    _model_or_skip()
    pytest.importorskip("llama_index.embeddings.huggingface", reason=INSTALL_HINT)
    model = craft_minilm_embedding()
    a = model.get_text_embedding("Who won Super Bowl 50?")
    b = model.get_query_embedding("Who won Super Bowl 50?")
    c = model.get_text_embedding("The Broncos beat the Panthers 24-10.")
    assert len(a) == len(c) == 384
    assert a == pytest.approx(b, abs=1e-5)  # no query instruction: same text, same vector
    cosine = sum(x * y for x, y in zip(a, c, strict=True))
    cosine /= math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in c))
    assert 0.0 < cosine < 0.99
