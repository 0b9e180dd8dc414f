"""A hub id as the model: taken from the Hugging Face cache as transformers would, or refused
with an error saying how to make it available (this machine has no hub access)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from craft_rag.engine.engine import CraftEngine, EngineSettings
from craft_rag.engine.model import local_model_folder


def _cached_snapshot(cache: Path, repo: str) -> Path:
    """A Hugging Face cache entry for ``repo`` laid out as huggingface_hub writes it."""
    entry = cache / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("a" * 40, encoding="utf-8")
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}), encoding="utf-8")
    return snapshot


def test_a_cached_hub_id_resolves_to_its_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    snapshot = _cached_snapshot(tmp_path, "org/tiny-model")
    assert Path(local_model_folder("org/tiny-model")).resolve() == snapshot.resolve()


def test_an_uncached_hub_id_offline_names_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match=r"not available locally.*HF_HUB_OFFLINE"):
        local_model_folder("org/not-downloaded")


def test_the_engine_refuses_an_unavailable_hub_id_before_starting_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: "has no chat template" (the id was read as a local folder)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match=r"HF_HUB_OFFLINE=1 is set: download it first"):
        CraftEngine(EngineSettings(model="org/not-downloaded"))
