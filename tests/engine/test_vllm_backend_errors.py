"""Settings validation and the missing-vLLM error, without vLLM."""

from __future__ import annotations

import importlib

import pytest

from craft_rag.engine.backends.vllm import backend as vllm_backend
from craft_rag.engine.backends.vllm.backend import EngineSettings, import_vllm


def test_missing_vllm_names_the_extras(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def fake_import(name: str, package: str | None = None) -> object:
        if name == "vllm":
            raise ModuleNotFoundError("No module named 'vllm'", name="vllm")
        return real(name, package)

    monkeypatch.setattr(vllm_backend.importlib, "import_module", fake_import)
    with pytest.raises(ImportError, match=r"pip install 'craft-rag\[cpu\]'.*'craft-rag\[gpu\]'"):
        import_vllm()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": 33}, "multiple of 16"),
        ({"block_size": 64, "max_model_len": 32}, "max_model_len"),
        ({"kv_events_endpoint": "tcp://127.0.0.1:5557"}, "bind"),
    ],
)
def test_bad_settings_say_what_to_use(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineSettings(**kwargs)  # type: ignore[arg-type]


def test_start_hints() -> None:
    settings = EngineSettings()
    assert "kv_cache_memory_bytes" in vllm_backend._start_hint(
        ValueError("Available memory ... less than requested memory for kv"), settings
    )
    assert "uninstall torchvision" in vllm_backend._start_hint(
        RuntimeError("operator torchvision::nms does not exist"), settings
    )
    assert "docs/engine.md" in vllm_backend._start_hint(RuntimeError("???"), settings)
