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
    # No torch.set_num_threads here: the thread count is process-wide, and the session's shared
    # vLLM engine fails its CPU attention check (thread_num 2 vs 1) once it is changed.
    return load_model(folder)
