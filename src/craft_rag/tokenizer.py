"""Tokenizers for prompt assembly and the replay simulator.

The embedded model's own tokenizer (``tokenizer.json`` of the prepared SmolLM2 folder, loaded
with the ``tokenizers`` library) is used when available. Otherwise the documented fallback,
:class:`HashingTokenizer`, splits text into words and punctuation (regex ``\\w+|[^\\w\\s]``) and
maps each piece to a stable 31-bit id; it over-counts tokens by ~10-30% versus BPE but keeps
segment boundaries exact, which is what prefix-reuse accounting needs.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Protocol

from craft_rag.paths import default_model_dir


class Tokenizer(Protocol):
    """Anything that turns text into token ids without adding special tokens."""

    name: str

    def encode(self, text: str) -> list[int]: ...


_PIECE = re.compile(r"\w+|[^\w\s]", re.UNICODE)


class HashingTokenizer:
    """Fallback tokenizer: regex pieces -> blake2b-derived ids. Deterministic across runs."""

    name = "hashing-fallback"

    def encode(self, text: str) -> list[int]:
        return [
            int.from_bytes(hashlib.blake2b(p.encode("utf-8"), digest_size=4).digest(), "big")
            & 0x7FFFFFFF
            for p in _PIECE.findall(text)
        ]


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library (no special tokens added)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))
        self.name = f"hf:{path.parent.name}"

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)


def load_tokenizer(model_dir: Path | None = None, *, fallback: bool = True) -> Tokenizer:
    """The tokenizer of ``model_dir`` (default: the prepared embedded model), or the hashing
    fallback when that folder has no ``tokenizer.json`` and ``fallback`` is true."""
    folder = model_dir if model_dir is not None else default_model_dir()
    path = folder / "tokenizer.json"
    if path.is_file():
        try:
            return HFTokenizer(path)
        except ImportError:
            if not fallback:
                raise
    if not fallback:
        msg = f"no tokenizer.json in {folder}; run `craft-rag model prepare` first"
        raise FileNotFoundError(msg)
    return HashingTokenizer()
