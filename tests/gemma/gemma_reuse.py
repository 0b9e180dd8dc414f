"""Re-expose chosen SmolLM2 tests and fixtures in a Gemma test module."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

_TESTS = Path(__file__).resolve().parent.parent


def load_tests(relative: str) -> ModuleType:
    """A SmolLM2 test module loaded under a private name, to re-expose chosen tests and
    fixtures in a Gemma module (pytest collects them there, with this folder's fixtures)."""
    path = _TESTS / relative
    name = "gemma_reuse_" + relative.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
