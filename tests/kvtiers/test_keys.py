"""Chain keys: deterministic, prefix-shaped, salted."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from craft_rag.kvtiers.keys import KEY_TAG, BlockKey, chain_keys


def make_tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_only_full_blocks_are_keyed() -> None:
    assert len(chain_keys(make_tokens(7), 4, None)) == 1
    assert len(chain_keys(make_tokens(8), 4, None)) == 2
    assert chain_keys(make_tokens(3), 4, None) == []


def test_first_key_matches_the_documented_encoding() -> None:
    tokens = [1, 2, 2**40, 7]
    head = KEY_TAG + struct.pack("<I", 0)
    expected0 = hashlib.sha256(head + struct.pack("<4q", *tokens)).digest()
    expected1 = hashlib.sha256(expected0 + struct.pack("<4q", 5, 6, 7, 8)).digest()
    assert chain_keys([*tokens, 5, 6, 7, 8], 4, None) == [expected0, expected1]
    salted = KEY_TAG + struct.pack("<I", 1) + b"t"
    assert chain_keys(tokens, 4, "t") == [
        hashlib.sha256(salted + struct.pack("<4q", *tokens)).digest()
    ]


def test_a_shared_prefix_shares_keys_and_a_changed_token_changes_every_later_key() -> None:
    a = chain_keys(make_tokens(16), 4, None)
    b = chain_keys([*make_tokens(16)[:9], 999, *make_tokens(16)[10:]], 4, None)
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))


def test_keys_depend_on_block_size_and_position() -> None:
    tokens = [5, 5, 5, 5, 5, 5, 5, 5]
    keys = chain_keys(tokens, 4, None)
    assert keys[0] != keys[1]  # same tokens, different prefix
    assert chain_keys(tokens, 8, None)[0] not in keys


def test_salts_separate_tenants_and_the_empty_salt_is_rejected() -> None:
    tokens = make_tokens(8)
    plain, a, b = (chain_keys(tokens, 4, s) for s in (None, "tenant-a", "tenant-b"))
    assert len({plain[0], a[0], b[0]}) == 3
    with pytest.raises(ValueError, match="non-empty"):
        chain_keys(tokens, 4, "")


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_block_size_is_a_value_error(bad: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        chain_keys(make_tokens(8), bad, None)


def test_token_ids_outside_int64_are_rejected() -> None:
    with pytest.raises(ValueError, match="token id"):
        chain_keys([-1, 0, 1, 2], 4, None)
    with pytest.raises(ValueError, match="token id"):
        chain_keys([2**63, 0, 1, 2], 4, None)


def test_keys_are_stable_across_processes() -> None:
    code = (
        "from craft_rag.kvtiers.keys import chain_keys;"
        "print(chain_keys(list(range(12)), 4, 'x')[-1].hex())"
    )
    # a fresh interpreter has a different str-hash seed; the key must not move
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    ).stdout.strip()
    assert out == chain_keys(make_tokens(12), 4, "x")[-1].hex()
    assert isinstance(chain_keys(make_tokens(4), 4, None)[0], bytes)
    assert BlockKey(b"x") == b"x"
