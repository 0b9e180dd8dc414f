"""Library vs harness (issue 12 item 5): the library never imports the evaluation harness
(craft_rag_bench) and importing it loads none of the harness's dependencies."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "craft_rag"
HARNESS_ONLY = ("craft_rag_bench", "numpy", "tqdm", "pydantic", "faiss", "sentence_transformers")


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_library_module_imports_the_harness() -> None:
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 20
    offenders = [
        f"{path.relative_to(SRC)}: {name}"
        for path in files
        for name in imported_modules(path)
        if name.split(".")[0] == "craft_rag_bench"
    ]
    assert offenders == []


def test_importing_the_library_loads_no_harness_dependency() -> None:
    """A fresh interpreter imports the core, the engine facade, routing, stores and the CLI;
    none of the harness's packages (nor vllm/torch) may be loaded by that."""
    code = (
        "import sys, craft_rag, craft_rag.engine, craft_rag.routing, craft_rag.stores, "
        "craft_rag.replay, craft_rag.cli\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    loaded = set(
        subprocess.run(
            [sys.executable, "-c", code], check=True, capture_output=True, text=True
        ).stdout.split()
    )
    assert "craft_rag" in loaded
    assert loaded.isdisjoint({*HARNESS_ONLY, "vllm", "torch"}), loaded & {*HARNESS_ONLY, "vllm"}


def test_fit_ttft_model_without_numpy_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from craft_rag.routing import TTFTPoint, fit_ttft_model

    monkeypatch.setitem(sys.modules, "numpy", None)  # makes `import numpy` raise ImportError
    points = [TTFTPoint(uncached=n, cached=0, ttft_s=0.01 * n) for n in (10, 20, 30)]
    with pytest.raises(ImportError, match=r"craft-rag\[routing\]"):
        fit_ttft_model(points)
