"""Every ```python block of README.md and docs/*.md, and every script in examples/, runs as
written, on the test run's ONE in-process engine.

The blocks construct ``CraftEngine()`` themselves (directly, or through ``CraftVLLM()`` /
``ChatCraftVLLM()``); :func:`_shared_engine` makes every such in-process construction return a
handle on the session's ``craft_engine`` whose ``close()`` does nothing, so a block costs its
requests, not an engine start. ``CraftEngine(server=...)`` is left alone.

A block is marked by an HTML comment on the line before its fence:
``<!-- docs-test: skip (reason) -->`` (a fragment; keep these few, each with a reason) or
``<!-- docs-test: server -->`` (needs ``craft-rag serve`` on 127.0.0.1:8000 and Redis on 6379:
runs under the ``server`` marker when ``CRAFT_RAG_DOCS_SERVER=1``).
"""

from __future__ import annotations

import os
import re
import runpy
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
_FENCE = re.compile(r"^```python\s*$")
_MARK = re.compile(r"^<!--\s*docs-test:\s*(skip|server)\s*(?:\((.*)\))?\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    code: str
    mark: str | None
    reason: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def extract_blocks(path: Path) -> list[Block]:
    """The ```python blocks of one markdown file, each with its marker comment (if any)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if _FENCE.match(lines[i]):
            start = i
            body: list[str] = []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            prev = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
            m = _MARK.match(prev.strip())
            blocks.append(
                Block(
                    path,
                    start + 1,
                    "\n".join(body) + "\n",
                    m.group(1) if m else None,
                    (m.group(2) or "") if m else "",
                )
            )
        i += 1
    return blocks


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _params() -> list[Any]:
    params: list[Any] = []
    for path in _doc_files():
        for block in extract_blocks(path):
            marks: list[Any] = [pytest.mark.engine]
            if block.mark == "skip":
                marks.append(pytest.mark.skip(reason=f"docs-test: skip ({block.reason})"))
            elif block.mark == "server":
                marks = [pytest.mark.server]
            params.append(pytest.param(block, id=block.name, marks=marks))
    return params


def test_extract_blocks_reads_markers(tmp_path: Path) -> None:
    doc = tmp_path / "d.md"
    doc.write_text(
        "text\n```python\nx = 1\n```\n<!-- docs-test: skip (fragment) -->\n"
        "```python\ny\n```\n<!-- docs-test: server -->\n\n```python\nz = 2\n```\n"
        "```bash\nnot python\n```\n",
        encoding="utf-8",
    )
    got = [(b.line, b.code, b.mark, b.reason) for b in extract_blocks(doc)]
    assert got == [(2, "x = 1\n", None, ""), (6, "y\n", "skip", "fragment"),
                   (11, "z = 2\n", "server", "")]


def test_every_skip_has_a_reason() -> None:
    for path in _doc_files():
        for block in extract_blocks(path):
            if block.mark == "skip":
                assert block.reason.strip(), f"{block.name}: docs-test skip without a reason"


@pytest.fixture
def _shared_engine(craft_engine: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """In-process ``CraftEngine(...)`` constructions return the session engine (not closed
    by the block); ``server=`` constructions start a real client as written."""
    import craft_rag.engine
    import craft_rag.engine.engine as engine_module

    real = engine_module.CraftEngine
    keep = {"close", "__enter__", "__exit__", "__class__", "__init__"}

    class _Meta(type):
        """``isinstance(x, CraftEngine)`` keeps meaning a real engine (the integrations check)."""

        def __instancecheck__(cls, obj: object) -> bool:
            return isinstance(obj, real)

    class _Factory(real, metaclass=_Meta):  # type: ignore[misc, valid-type]
        """Stands in for the class: ``server=`` builds a real client, anything else the
        session engine's handle."""

        def __new__(cls, *args: Any, server: str | None = None, **kwargs: Any) -> Any:
            if server is not None:
                return real(*args, server=server, **kwargs)
            return object.__new__(_Shared)

    class _Shared(_Factory):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            """Nothing to start: every other attribute is the session engine's."""

        def __getattribute__(self, name: str) -> Any:
            if name in keep:
                return object.__getattribute__(self, name)
            return getattr(craft_engine, name)

        def close(self) -> None:
            """The session engine outlives the block."""

        def __enter__(self) -> _Shared:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    factory = _Factory

    monkeypatch.setattr(craft_rag.engine, "CraftEngine", factory)
    monkeypatch.setattr(engine_module, "CraftEngine", factory)
    for name in ("llama_index.llms.craft_vllm.base",):
        try:
            module = __import__(name, fromlist=["CraftEngine"])
        except ImportError:
            continue
        monkeypatch.setattr(module, "CraftEngine", factory)
    craft_engine.reset_prefix_cache()
    yield


@pytest.mark.parametrize("block", _params())
def test_doc_block_runs(block: Block, _shared_engine: None) -> None:
    if block.mark == "server" and not os.environ.get("CRAFT_RAG_DOCS_SERVER"):
        pytest.skip("needs craft-rag serve on :8000 and Redis on :6379 (CRAFT_RAG_DOCS_SERVER=1)")
    code = compile(block.code, block.name, "exec")
    exec(code, {"__name__": "__docs_block__"})  # the docs' own code, as a reader runs it


_EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
# Each script as a user runs it, with its own options turned down to CI sizes (a few requests).
_SMALL_ARGS = {
    "langchain_chat.py": ["--turns", "2"],
    "langchain_lcel_rag.py": ["--questions", "2", "--k", "3"],
    "langgraph_chat.py": ["--passages", "20", "--max-tokens", "16"],
    "llamaindex_chat.py": ["--k", "2"],
    "llamaindex_query_engine.py": ["--questions", "2", "--k", "3"],
}


def test_every_example_has_ci_sizes() -> None:
    assert sorted(_SMALL_ARGS) == [p.name for p in _EXAMPLES]


@pytest.mark.engine
@pytest.mark.parametrize("script", _EXAMPLES, ids=[p.name for p in _EXAMPLES])
def test_example_runs(script: Path, _shared_engine: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(script), *_SMALL_ARGS.get(script.name, [])])
    # As `python examples/x.py` does: the script's folder first on sys.path (an example may
    # import a sibling example), and no sibling module left cached from an earlier example.
    monkeypatch.syspath_prepend(str(script.parent))
    for sibling in _EXAMPLES:
        monkeypatch.delitem(sys.modules, sibling.stem, raising=False)
    runpy.run_path(str(script), run_name="__main__")
