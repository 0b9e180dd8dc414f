"""Tokenizers: the hashing fallback and the loader's choice."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from craft_rag.tokenizer import HashingTokenizer, load_tokenizer


def test_hashing_tokenizer_pieces_and_ids() -> None:
    tok = HashingTokenizer()
    ids = tok.encode("Hello, world!")
    assert len(ids) == 4  # Hello , world !
    expected = int.from_bytes(hashlib.blake2b(b"Hello", digest_size=4).digest(), "big")
    assert ids[0] == expected & 0x7FFFFFFF
    assert all(0 <= i < 2**31 for i in ids)
    assert tok.encode("") == []
    assert tok.encode("   \n\t") == []
    assert tok.encode("a a") == [tok.encode("a")[0]] * 2


def test_hashing_tokenizer_is_stable_across_processes() -> None:
    code = (
        "from craft_rag.tokenizer import HashingTokenizer; "
        "print(HashingTokenizer().encode('x y'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONHASHSEED": "99", "PYTHONPATH": ":".join(sys.path)},
    ).stdout.strip()
    assert out == str(HashingTokenizer().encode("x y"))


def test_hashing_tokenizer_unicode() -> None:
    tok = HashingTokenizer()
    assert len(tok.encode("東京 🗼 é")) == 3  # word, symbol, word


def test_loader_falls_back_without_tokenizer_json(tmp_path: Path) -> None:
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HashingTokenizer)
    assert tok.name == "hashing-fallback"


def test_loader_without_fallback_says_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model prepare"):
        load_tokenizer(tmp_path, fallback=False)


def test_loader_reads_a_tokenizer_json(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]")
    hf = tokenizers.Tokenizer(model)
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    folder = tmp_path / "tiny-model"
    folder.mkdir()
    hf.save(str(folder / "tokenizer.json"))
    tok = load_tokenizer(folder, fallback=False)
    assert tok.name == "hf:tiny-model"
    assert tok.encode("hello world nope") == [1, 2, 0]
