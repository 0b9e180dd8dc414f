"""Issue 12 item 6: the integrations import only craft-rag's public names.

Every module of every integration package (``integrations/*/llama_index/**``,
``integrations/langchain-craft/langchain_craft``; tests excluded) is parsed with ``ast``; each
``craft_rag`` import must come from ``craft_rag`` or ``craft_rag.engine`` and name something in
that module's ``__all__``. A LlamaIndex distribution importing a *sibling* distribution (the LLM
using the postprocessor) must do so through the sibling's package root and its ``__all__``.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INTEGRATIONS = ROOT / "integrations"
# model_args (the familiar-argument table both integrations share) and redact are public
# modules of their own: integrations may import them.
PUBLIC = ("craft_rag", "craft_rag.engine", "craft_rag.engine.model_args", "craft_rag.redact")
LLAMA_CATEGORIES = ("postprocessor", "llms", "retrievers", "embeddings")


def _module_files() -> list[Path]:
    files = [
        *INTEGRATIONS.glob("*/llama_index/**/*.py"),
        *INTEGRATIONS.glob("langchain-craft/langchain_craft/**/*.py"),
    ]
    return sorted(p for p in files if "tests" not in p.relative_to(INTEGRATIONS).parts)


def _own_package(path: Path) -> str:
    """``llama_index.llms.craft_vllm`` for a file under that namespace, else ``langchain_craft``."""
    parts = path.relative_to(INTEGRATIONS).parts
    return ".".join(parts[1:4]) if parts[1] == "llama_index" else "langchain_craft"


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) for every import in ``path`` (TYPE_CHECKING and function-level
    imports included); ``import x.y`` gives module ``x.y`` and no names."""
    found: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, []) for a in node.names)
    return found


def _violations(path: Path, own: str | None = None) -> list[str]:
    """Every non-public craft import in ``path`` (``own``: the package the file belongs to)."""
    own = own or _own_package(path)
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    problems: list[str] = []
    for line, module, names in _imports(path):
        top = module.split(".")[0]
        if top == "craft_rag":
            target = module
            if target not in PUBLIC:
                problems.append(f"{where}:{line}: imports private module {module}")
                continue
        elif (
            module.startswith("llama_index.")
            and module.split(".")[1] in LLAMA_CATEGORIES
            and ".".join(module.split(".")[:3]) != own
            and "craft" in module.split(".")[2]
        ):
            target = ".".join(module.split(".")[:3])
            if module != target:
                problems.append(f"{where}:{line}: imports {module}, a sibling's internals")
                continue
        else:
            continue
        if not names:
            problems.append(f"{where}:{line}: `import {module}`; import public names instead")
            continue
        exported = set(importlib.import_module(target).__all__)
        problems.extend(
            f"{where}:{line}: {name} is not in {target}.__all__"
            for name in names
            if name not in exported
        )
    return problems


def test_the_integrations_are_found() -> None:
    packages = {_own_package(p) for p in _module_files()}
    assert {
        "llama_index.postprocessor.craft",
        "llama_index.llms.craft_vllm",
        "llama_index.retrievers.craft",
        "llama_index.embeddings.craft_minilm",
        "langchain_craft",
    } <= packages


@pytest.mark.parametrize("path", _module_files(), ids=lambda p: str(p.relative_to(INTEGRATIONS)))
def test_integration_imports_only_public_names(path: Path) -> None:
    assert _violations(path) == []


def test_the_checker_catches_private_imports(tmp_path: Path) -> None:
    """The check itself can fail: a private module, a name outside ``__all__`` and a sibling's
    internal module are each reported."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from craft_rag.engine.engine import CraftEngine\n"
        "from craft_rag import _not_exported\n"
        "from llama_index.postprocessor.craft.nodes import split_nodes\n"
        "from llama_index.postprocessor.craft import split_nodes as ok\n"
        "from craft_rag import Chunk\n",
        encoding="utf-8",
    )
    found = _violations(probe, own="llama_index.llms.craft_vllm")
    assert len(found) == 3, found
    assert "private module craft_rag.engine.engine" in found[0]
    assert "_not_exported is not in craft_rag.__all__" in found[1]
    assert "sibling's internals" in found[2]
