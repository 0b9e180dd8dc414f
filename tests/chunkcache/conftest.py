"""The real embedded model (SmolLM2-135M, fp32, eager attention), loaded once per session.
Skipped where the model is not prepared (``craft-rag model prepare``) or torch is missing."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def model() -> Any:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from craft_rag.chunkcache import load_model
    from craft_rag.paths import default_model_dir

    folder = default_model_dir()
    if not (folder / "model.safetensors").is_file():
        pytest.skip(f"embedded model not prepared at {folder}: run `craft-rag model prepare`")
    import torch

    torch.manual_seed(0)
    # One thread: on a shared 2-core box several threads per process thrash (5x slower here).
    torch.set_num_threads(1)
    return load_model(folder)
