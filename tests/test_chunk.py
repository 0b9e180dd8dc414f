"""Chunk identity (issue 3, item 1): caller id when given, else sha256 of the text."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from craft_rag.chunk import CONTENT_KEY_PREFIX, Chunk, content_key, make_chunk
from craft_rag.types import BlockHash, as_block_hash


def test_caller_id_is_the_key() -> None:
    chunk = make_chunk("some text", id="doc-17:2048", score=0.5, num_tokens=3)
    assert chunk.key == "doc-17:2048"
    assert chunk.text == "some text"
    assert chunk.score == 0.5
    assert chunk.num_tokens == 3


def test_content_key_is_sha256_of_utf8_text() -> None:
    text = "Paris is the capital of France."
    expected = "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert content_key(text) == expected
    assert make_chunk(text).key == expected
    assert expected.startswith(CONTENT_KEY_PREFIX)


def test_content_key_is_stable_across_processes() -> None:
    # Python's hash() is salted per process; the key must not be.
    code = "from craft_rag.chunk import content_key; print(content_key('héllo wörld'))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONHASHSEED": "123", "PYTHONPATH": ":".join(sys.path)},
    ).stdout.strip()
    assert out == content_key("héllo wörld")


def test_same_text_under_two_ids_is_two_chunks() -> None:
    a = make_chunk("shared paragraph", id="doc-1:0")
    b = make_chunk("shared paragraph", id="doc-2:0")
    assert a.key != b.key
    assert a != b


def test_same_id_and_text_are_equal_and_hash_alike_metadata_ignored() -> None:
    a = make_chunk("t", id="x", metadata={"source": "a"})
    b = make_chunk("t", id="x", metadata={"source": "b"})
    assert a == b
    assert hash(a) == hash(b)


def test_id_without_text_is_allowed() -> None:
    chunk = make_chunk(id="doc-3:0")
    assert chunk.key == "doc-3:0"
    assert chunk.text == ""


def test_empty_text_without_id_is_a_content_chunk() -> None:
    assert make_chunk("").key == content_key("")


def test_neither_id_nor_text_names_both_fields() -> None:
    with pytest.raises(ValueError, match="'id'") as info:
        make_chunk()
    assert "'text'" in str(info.value)


@pytest.mark.parametrize("bad_id", [5, 3.0, b"bytes", ["x"], ""])
def test_non_string_or_empty_id_is_rejected(bad_id: object) -> None:
    with pytest.raises(ValueError, match="'id'"):
        make_chunk("t", id=bad_id)


def test_non_string_text_is_rejected() -> None:
    with pytest.raises(ValueError, match="'text'"):
        make_chunk(42)


@pytest.mark.parametrize("bad", [-1, 1.5, "3"])
def test_bad_num_tokens_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="'num_tokens'"):
        make_chunk("t", num_tokens=bad)


def test_non_numeric_score_is_rejected() -> None:
    with pytest.raises(ValueError, match="'score'"):
        make_chunk("t", score="high")


def test_unicode_ids_and_text() -> None:
    chunk = make_chunk("東京は日本の首都です 🗼", id="文書-7:０")
    assert chunk.key == "文書-7:０"
    other = make_chunk("東京は日本の首都です 🗼")
    assert other.key == "sha256:" + hashlib.sha256("東京は日本の首都です 🗼".encode()).hexdigest()


def test_chunk_is_frozen() -> None:
    chunk = make_chunk("t", id="x")
    with pytest.raises(AttributeError):
        chunk.key = "y"


@settings(max_examples=50, deadline=None)
@given(st.text(), st.text())
def test_content_keys_collide_only_for_equal_text(a: str, b: str) -> None:
    assert (content_key(a) == content_key(b)) == (a == b)


def test_chunk_constructor_direct() -> None:
    chunk = Chunk(key=content_key("x"), text="x")
    assert chunk.score is None and chunk.num_tokens is None


def test_as_block_hash() -> None:
    assert as_block_hash(b"\x01\x02") == BlockHash(b"\x01\x02")
    # ints are normalised to signed big-endian bytes; distinct ints stay distinct
    assert as_block_hash(1) != as_block_hash(-1)
    assert as_block_hash(255) != as_block_hash(-1)
    assert as_block_hash(2**64 - 1) == (2**64 - 1).to_bytes(9, "big", signed=True)
    with pytest.raises(ValueError, match="bytes or int"):
        as_block_hash("abc")


@settings(max_examples=100, deadline=None)
@given(st.integers(), st.integers())
def test_as_block_hash_is_injective_on_ints(a: int, b: int) -> None:
    assert (as_block_hash(a) == as_block_hash(b)) == (a == b)
