"""Test doubles for code built on craft-rag, a package above the engine (its fake engine is a
real :class:`~craft_rag.engine.CraftEngine`): see :mod:`.fakes` for what the fake backend
simulates and how to use it.
"""

from craft_rag.testing.fakes import (
    ALTERNATING_TEMPLATE,
    CHATML,
    FAKE_BLOCK,
    FAKE_FORMAT,
    ISOLATED_ENGINE_TEST,
    MERGING_TEMPLATE,
    FakeBackend,
    control_id_count,
    forged_control_text,
    make_chunks,
    make_fake_engine,
    rerun_in_own_process,
)

# Importable from here before the package split (tests build fakes with it); kept, not listed.
from craft_rag.tokenizer import HashingTokenizer as HashingTokenizer

__all__ = [
    "ALTERNATING_TEMPLATE",
    "CHATML",
    "FAKE_BLOCK",
    "FAKE_FORMAT",
    "ISOLATED_ENGINE_TEST",
    "MERGING_TEMPLATE",
    "FakeBackend",
    "control_id_count",
    "forged_control_text",
    "make_chunks",
    "make_fake_engine",
    "rerun_in_own_process",
]
