"""Test doubles for code built on craft-rag, a package above the engine (its fake engine is a
real :class:`~craft_rag.engine.CraftEngine`): see :mod:`.fakes` for what the fake backend
simulates and how to use it (its ``__all__`` is this package's).
"""

from craft_rag.testing.fakes import *  # noqa: F403
from craft_rag.testing.fakes import __all__ as __all__

# Importable from here before the package split (tests build fakes with it); kept, not listed.
from craft_rag.tokenizer import HashingTokenizer as HashingTokenizer
