"""Disk-tier read cost of a run of R consecutive blocks of one chunk-prefix, per on-disk layout.

Usage: ``nice -n 10 python scripts/kvtiers_disk_io.py DIR [--runs R ...] [--reps N]``

For each R it writes R blocks of random bytes (the size of one 32-token block of SmolLM2-135M
float32 KV: 30 layers x 3 KV heads x 32 tokens x 2 x 64 x 4 B) under DIR (created 0700) in each
layout, drops them from the page cache (``POSIX_FADV_DONTNEED`` after the fsync'd write), then
times reading the run back *verified* (checksums and token ids) the way the store does:

- ``per-block``: one file per block (``disk_tier.read_block`` per block);
- ``segment``: a prototype of the run's blocks in one contiguous file (each block's record is
  the per-block file's bytes, header then payload, back to back): one sequential read, then the
  same header check and payload blake2b per block.

It also times a warm read (page cache hot), a cold read without any verification (the I/O
part alone) and the payload checksum alone, and prints the
per-block compute time of this engine's cost model (``craft_rag.kvtiers.cost_model``) for
comparison. One JSON line per (layout, R) on stderr as it goes, the whole result on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from craft_rag.files import atomic_writer
from craft_rag.kvtiers import disk_tier
from craft_rag.kvtiers.cost_model import default_cost_model
from craft_rag.kvtiers.keys import BlockKey, chain_keys

BLOCK_TOKENS = 32
BLOCK_BYTES = 30 * 3 * BLOCK_TOKENS * 2 * 64 * 4  # 1,474,560


def _drop_cache(folder: Path) -> None:
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


Block = tuple[BlockKey, BlockKey | None, list[int], int]  # key, parent, token ids, prefix


def _layout_run(
    folder: Path, layout: str, runs: int, rep: int
) -> tuple[list[BlockKey], list[Block], list[bytes]]:
    tokens = [(rep * 100_003 + i) % 49_000 for i in range(runs * BLOCK_TOKENS)]
    keys = chain_keys(tokens, BLOCK_TOKENS, f"bench-{layout}-{rep}")
    payloads = [os.urandom(BLOCK_BYTES) for _ in range(runs)]
    blocks: list[Block] = []
    for j, key in enumerate(keys):
        block_tokens = tokens[j * BLOCK_TOKENS : (j + 1) * BLOCK_TOKENS]
        blocks.append((key, keys[j - 1] if j else None, block_tokens, j * BLOCK_TOKENS))
    return keys, blocks, payloads


def _write(folder: Path, layout: str, blocks: list[Block], payloads: list[bytes]) -> None:
    if layout == "per-block":
        for (key, parent, toks, prefix), payload in zip(blocks, payloads, strict=True):
            disk_tier.write_block(folder, key, parent, toks, prefix, payload)
    else:
        with atomic_writer(folder / "segment.kvs", binary=True) as handle:
            for (key, parent, toks, prefix), payload in zip(blocks, payloads, strict=True):
                tmp = disk_tier.write_block(folder, key, parent, toks, prefix, payload)
                handle.write(tmp.read_bytes())  # type: ignore[arg-type]
                tmp.unlink()


def _read_raw(folder: Path) -> int:
    """The I/O part alone: read every file of ``folder`` whole, no parsing, no checksum."""
    total = 0
    for path in sorted(folder.iterdir()):
        with open(path, "rb") as handle:
            total += len(handle.read())
    return total


def _read(folder: Path, layout: str, keys: list[BlockKey], blocks: list[Block]) -> int:
    total = 0
    if layout == "per-block":
        for key, (_k, _p, toks, _pre) in zip(keys, blocks, strict=True):
            header, data = disk_tier.read_block(folder, key)
            assert list(header.token_ids) == list(toks)
            total += len(data)
    else:
        fd = os.open(folder / "segment.kvs", os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            buf = bytearray(size)
            view = memoryview(buf)
            got = 0
            while got < size:
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    raise disk_tier.CorruptBlock("short segment")
                got += n
        finally:
            os.close(fd)
        off = 0
        for key, (_k, _p, toks, _pre) in zip(keys, blocks, strict=True):
            ntok = disk_tier._token_count(bytes(view[off : off + disk_tier._FIXED.size]))
            hsize = disk_tier.header_bytes(ntok)
            plen = len(buf) // len(keys) - hsize
            header = disk_tier._parse_header(bytes(view[off : off + hsize]), key, hsize + plen)
            payload = view[off + hsize : off + hsize + header.payload_len]
            digest = hashlib.blake2b(payload, digest_size=32).digest()
            if digest != header.payload_digest:
                raise disk_tier.CorruptBlock("payload checksum mismatch")
            assert list(header.token_ids) == list(toks)
            total += len(payload)
            off += hsize + header.payload_len
    return total


def _blake2b_s(reps: int = 20) -> float:
    """Median time of the payload checksum alone (what every verified read pays on top of I/O)."""
    payload = os.urandom(BLOCK_BYTES)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        hashlib.blake2b(payload, digest_size=32).digest()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--runs", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    root = disk_tier.prepare_dir(args.dir)
    cost = default_cost_model()
    results: list[dict[str, object]] = []
    out: dict[str, object] = {
        "block_bytes": BLOCK_BYTES,
        "compute_s_per_block": {
            str(p): round(cost.block_cost(p, BLOCK_TOKENS), 4) for p in (0, 256, 512, 1024)
        },
        "blake2b_ms_per_block": round(1e3 * _blake2b_s(), 3),
        "results": results,
    }
    for runs in args.runs:
        for layout in ("per-block", "segment"):
            cold: list[float] = []
            warm: list[float] = []
            raw: list[float] = []
            for rep in range(args.reps):
                folder = root / f"{layout}-{runs}-{rep}"
                folder.mkdir(mode=0o700)
                keys, blocks, payloads = _layout_run(folder, layout, runs, rep)
                _write(folder, layout, blocks, payloads)
                _drop_cache(folder)
                t0 = time.perf_counter()
                n = _read(folder, layout, keys, blocks)
                cold.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                _read(folder, layout, keys, blocks)
                warm.append(time.perf_counter() - t0)
                _drop_cache(folder)
                t0 = time.perf_counter()
                _read_raw(folder)
                raw.append(time.perf_counter() - t0)
                assert n == runs * BLOCK_BYTES
                shutil.rmtree(folder)
            row = {
                "layout": layout,
                "blocks": runs,
                "cold_ms_per_block_median": round(1e3 * statistics.median(cold) / runs, 3),
                "cold_ms_per_block_min": round(1e3 * min(cold) / runs, 3),
                "warm_ms_per_block_median": round(1e3 * statistics.median(warm) / runs, 3),
                "cold_unverified_ms_per_block_median": round(
                    1e3 * statistics.median(raw) / runs, 3
                ),
            }
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
