"""The disk tier's files: one verified, private file per KV block, named by the block's key.

File layout (little-endian), ``header`` then ``payload``:

- fixed part, :data:`_FIXED` (88 bytes): magic ``b"CRKV"``, format version (u16), flags (u16,
  bit 0 = has parent), key (32 bytes), parent key (32 bytes, zeros if none), token count (u32),
  prefix token count (u32), payload length (u64);
- the block's token ids, int64 each;
- blake2b-256 of the payload (32 bytes), then blake2b-128 of everything before it in the header
  (16 bytes), so a header can be validated without reading the payload (warm restart scans only
  headers).

Header overhead per block: ``136 + 8 * tokens`` bytes (1,160 bytes for a 128-token block);
capacity accounting in the store counts payload bytes only.

Names: ``<key hex>.kv`` under the tier directory. The key is a sha256 we computed, so no user text
ever names a file we write. Files are written with :func:`craft_rag.files.atomic_writer` (temp file
+ fsync + rename, mode 0600); the directory is created 0700 and refused if others can read it.

ContiguousKV's lesson is that the unit of I/O should be the unit of reuse. Here it is one block
(vLLM's block of ``block_size`` tokens, ~1.5 MB for 32 tokens of SmolLM2-135M in float32): the
engine hits, loads and evicts whole blocks, and one block is one ``read()`` of one file, so there is
no read amplification. A contiguous chunk-prefix *segment* file (a saved run's blocks in one file,
one sequential read per run) was measured and not adopted (``scripts/kvtiers_disk_io.py``,
docs/kv-tiers.md "Disk layout and ContiguousKV"): a verified read costs ~4-5 ms per block with the
page cache dropped, about half of it the payload's blake2b, and the segment saved at most ~1 ms
per block of the I/O part, against ~90 ms to compute the block. It would also make the unit of
eviction (a leaf block) smaller than the unit of storage.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from craft_rag.files import atomic_writer
from craft_rag.kvtiers.keys import KEY_BYTES, BlockKey, encode_tokens

MAGIC = b"CRKV"
VERSION = 1
_FIXED = struct.Struct("<4sHH32s32sIIQ")
_PAYLOAD_DIGEST = 32
_HEADER_DIGEST = 16
_MAX_TOKENS = 1 << 20
_NAME = re.compile(r"^[0-9a-f]{64}\.kv$")
_TEMP = re.compile(r"^\.[0-9a-f]{64}\.kv\.[0-9a-f]{16}\.tmp$")
SUFFIX = ".kv"


def header_bytes(tokens: int) -> int:
    """Size of a file's header for a block of ``tokens`` tokens."""
    return _FIXED.size + 8 * tokens + _PAYLOAD_DIGEST + _HEADER_DIGEST


class CorruptBlock(Exception):
    """A tier file with our magic that fails validation (truncated, flipped bytes, wrong name)."""


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """A validated header: what the index needs, without the payload."""

    key: BlockKey
    parent: BlockKey | None
    token_ids: tuple[int, ...]
    prefix_tokens: int
    payload_len: int
    payload_digest: bytes
    mtime_ns: int


def prepare_dir(path: Path) -> Path:
    """Validate (and create, mode 0700) the tier directory; return it resolved.

    Raises ``FileNotFoundError`` if its parent folder is missing, ``NotADirectoryError`` if it is
    a file or a symlink, ``PermissionError`` if it is not writable or group/others may access it
    (fix: ``chmod 700 <dir>``). Cost: a few stats, at most one mkdir.
    """
    path = Path(path)
    if path.is_symlink():
        msg = f"tier directory {path} is a symlink; pass the real directory"
        raise NotADirectoryError(msg)
    if not path.exists():
        if not path.parent.is_dir():
            msg = f"folder {path.parent} does not exist; create it first"
            raise FileNotFoundError(msg)
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)  # mkdir's mode is masked by the umask
    if not path.is_dir():
        msg = f"tier directory {path} is not a directory"
        raise NotADirectoryError(msg)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        msg = f"tier directory {path} has mode {mode:o}; KV is private: run chmod 700 {path}"
        raise PermissionError(msg)
    if not os.access(path, os.W_OK | os.X_OK):
        msg = f"tier directory {path} is not writable"
        raise PermissionError(msg)
    return path.resolve()


def block_path(folder: Path, key: BlockKey) -> Path:
    """The file of ``key`` under ``folder``."""
    return folder / f"{bytes(key).hex()}{SUFFIX}"


def write_block(
    folder: Path,
    key: BlockKey,
    parent: BlockKey | None,
    token_ids: Sequence[int],
    prefix_tokens: int,
    payload: bytes,
) -> Path:
    """Write one block file atomically (0600). Cost: blake2b over the payload, one fsync."""
    tokens = encode_tokens(token_ids)
    flags = 1 if parent is not None else 0
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        flags,
        bytes(key),
        bytes(parent or b"\0" * KEY_BYTES),
        len(token_ids),
        prefix_tokens,
        len(payload),
    )
    head = fixed + tokens + hashlib.blake2b(payload, digest_size=_PAYLOAD_DIGEST).digest()
    head += hashlib.blake2b(head, digest_size=_HEADER_DIGEST).digest()
    path = block_path(folder, key)
    with atomic_writer(path, binary=True) as handle:
        handle.write(head)  # type: ignore[arg-type]
        handle.write(payload)  # type: ignore[arg-type]
    return path


def _parse_header(data: bytes, name_key: BlockKey | None, file_size: int) -> BlockHeader:
    """Validate a header at the start of ``data``; ``CorruptBlock`` on any mismatch."""
    if len(data) < _FIXED.size:
        raise CorruptBlock("truncated fixed header")
    _magic, version, flags, key, parent, ntok, prefix, plen = _FIXED.unpack_from(data)
    if version != VERSION:
        raise CorruptBlock(f"format version {version}, expected {VERSION}")
    if flags not in (0, 1) or ntok > _MAX_TOKENS:
        raise CorruptBlock("bad flags or token count")
    size = header_bytes(ntok)
    if len(data) < size:
        raise CorruptBlock("truncated header")
    body = data[: size - _HEADER_DIGEST]
    expected = data[size - _HEADER_DIGEST : size]
    if hashlib.blake2b(body, digest_size=_HEADER_DIGEST).digest() != expected:
        raise CorruptBlock("header checksum mismatch")
    if name_key is not None and key != name_key:
        raise CorruptBlock("file name does not match the key in its header")
    if file_size != size + plen:
        raise CorruptBlock(f"file is {file_size} bytes, header says {size + plen}")
    off = _FIXED.size
    # a child's key is sha256(parent key + its tokens): check it, so a header can never claim a
    # prefix it does not have (nor close a parent cycle); a root's key also hashes the tenant's
    # salt, which is not stored, so roots are checked by their token ids at load time
    if flags and hashlib.sha256(parent + data[off : off + 8 * ntok]).digest() != key:
        raise CorruptBlock("key does not hash the parent key and token ids")
    token_ids = struct.unpack_from(f"<{ntok}q", data, off)
    digest = data[off + 8 * ntok : off + 8 * ntok + _PAYLOAD_DIGEST]
    return BlockHeader(
        BlockKey(key),
        BlockKey(parent) if flags else None,
        tuple(token_ids),
        prefix,
        plen,
        bytes(digest),
        0,
    )


def _is_ours(data: bytes) -> bool:
    return data[: len(MAGIC)] == MAGIC


def read_block(folder: Path, key: BlockKey) -> tuple[BlockHeader, bytes]:
    """Read and fully verify ``key``'s file (header checksum, name, size, payload blake2b).

    Raises ``FileNotFoundError`` if absent, ``CorruptBlock`` if it fails any check (a file
    without our magic at our name is corrupt too). Cost: one open + read of the file, one
    blake2b over the payload. Never follows a symlink.
    """
    path = block_path(folder, key)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as handle:
        file_size = os.fstat(handle.fileno()).st_size
        head = handle.read(_FIXED.size)
        if not _is_ours(head):
            raise CorruptBlock("no magic")
        if len(head) == _FIXED.size:
            head += handle.read(header_bytes(_token_count(head)) - _FIXED.size)
        header = _parse_header(head, key, file_size)
        # read the payload straight into its own bytes object: no 1.5 MB slice copy
        payload = handle.read(header.payload_len)
    if len(payload) != header.payload_len:
        raise CorruptBlock("file shrank while reading")
    if hashlib.blake2b(payload, digest_size=_PAYLOAD_DIGEST).digest() != header.payload_digest:
        raise CorruptBlock("payload checksum mismatch")
    return header, payload


def _token_count(fixed: bytes) -> int:
    """The token count field of a fixed header, capped so a damaged one cannot ask for GBs."""
    return min(int(struct.unpack_from("<I", fixed, 72)[0]), _MAX_TOKENS)


def remove_block(folder: Path, key: BlockKey) -> None:
    """Delete ``key``'s file if present. Cost: one unlink."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(block_path(folder, key))


def scan(folder: Path) -> Iterator[BlockHeader | Path]:
    """Headers of the valid block files in ``folder``; yields the ``Path`` of each corrupt one.

    Reads each file's header only (not its payload). Files whose names are not ours, symlinks
    and files without our magic are skipped (left alone); leftover temp files of an interrupted
    write are deleted. Cost: one stat and one small read per file.
    """
    with os.scandir(folder) as entries:
        for entry in entries:
            if _TEMP.match(entry.name) and entry.is_file(follow_symlinks=False):
                remove_block_path(Path(entry.path))
                continue
            if not _NAME.match(entry.name) or not entry.is_file(follow_symlinks=False):
                continue
            info = entry.stat(follow_symlinks=False)
            with open(entry.path, "rb") as handle:
                head = handle.read(_FIXED.size)
                if not _is_ours(head):
                    continue
                if len(head) == _FIXED.size:
                    head += handle.read(header_bytes(_token_count(head)) - _FIXED.size)
            key = BlockKey(bytes.fromhex(entry.name[: -len(SUFFIX)]))
            try:
                parsed = _parse_header(head, key, info.st_size)
            except CorruptBlock:
                yield Path(entry.path)
                continue
            yield BlockHeader(
                parsed.key,
                parsed.parent,
                parsed.token_ids,
                parsed.prefix_tokens,
                parsed.payload_len,
                parsed.payload_digest,
                info.st_mtime_ns,
            )


def remove_block_path(path: Path) -> None:
    """Delete one file of ours by path if present (corrupt or leftover temp files)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def load_headers(folder: Path) -> tuple[list[BlockHeader], int]:
    """Warm restart: the valid headers in ``folder``, oldest file first, and how many corrupt
    files of ours were deleted (bad header, wrong name or size, empty block). Cost: :func:`scan`.
    """
    headers: list[BlockHeader] = []
    corrupt = 0
    for found in scan(folder):
        if isinstance(found, Path):
            remove_block_path(found)
            corrupt += 1
        elif found.payload_len < 1 or not found.token_ids:
            remove_block(folder, found.key)
            corrupt += 1
        else:
            headers.append(found)
    headers.sort(key=lambda h: (h.mtime_ns, h.prefix_tokens))
    return headers, corrupt
