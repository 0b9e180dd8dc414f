"""On-disk cache of passage embeddings, so a second index build skips the encoder.

Layout: ``<cache_dir>/embeddings/<key>.npy`` (float32, ``(n, dim)``) plus ``<key>.json`` (what the
key covers, for humans). The key is sha256 over the embedder's ``model_id`` and every passage's
id and content, in order: any change to the model, a passage, or the order gives a new file.
Passages are cached in shards, one per contiguous run of the same dataset, so the union corpus
and a single dataset's corpus share their shards. Writes go through
:func:`craft_rag.files.atomic_writer` (a private temp file renamed into place, mode 0600), so
concurrent builders never read a half-written file.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Sequence
from itertools import groupby
from pathlib import Path
from typing import IO, Protocol, cast

import numpy as np

from craft_rag.files import atomic_writer, write_atomic
from craft_rag_bench.datasets import Passage
from craft_rag_bench.paths import index_cache_dir
from craft_rag_bench.retrieval.embedder import Embeddings


class PassageEncoder(Protocol):
    """What the cache needs from an embedder (see :class:`~craft_rag_bench.retrieval.Embedder`)."""

    @property
    def model_id(self) -> str: ...

    @property
    def dim(self) -> int: ...

    def encode(self, texts: Sequence[str], *, progress: object = None) -> Embeddings: ...


def shard_key(model_id: str, passages: Sequence[Passage]) -> str:
    """sha256 hex of the model id and the passages' ids and contents. O(total text)."""
    digest = hashlib.sha256(model_id.encode("utf-8") + b"\0")
    for p in passages:
        digest.update(p.id.encode("utf-8") + b"\0" + p.content.encode("utf-8") + b"\0")
    return digest.hexdigest()


def _load_shard(path: Path, n: int, dim: int) -> Embeddings | None:
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None  # unreadable or truncated: recompute
    if array.dtype != np.float32 or array.shape != (n, dim):
        return None
    return np.ascontiguousarray(array)


def _save_shard(folder: Path, key: str, array: Embeddings, meta: dict[str, object]) -> None:
    """Write one shard (``.npy``, then its ``.json`` note) through
    :func:`craft_rag.files.atomic_writer`: private (0600) temp files renamed into place, so a
    crash leaves either no shard or a whole one (a truncated ``.npy`` is also recomputed)."""
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_writer(folder / f"{key}.npy", binary=True) as handle:
        np.save(cast("IO[bytes]", handle), array, allow_pickle=False)
    write_atomic(folder / f"{key}.json", json.dumps(meta, indent=1))


def embed_passages(
    passages: Sequence[Passage],
    encoder: PassageEncoder,
    *,
    cache_dir: Path | None = None,
    show_progress: bool = True,
    use_cache: bool = True,
) -> Embeddings:
    """Embeddings of ``passages`` (row i = passage i), from the cache where possible.

    Cost: hashing all texts (~50 ms per 10k passages) plus, for shards not cached, the encoder
    (minutes per 10k passages on a small CPU); a tqdm bar on stderr counts encoded passages.
    Side effect: writes missing shards under ``cache_dir`` (default
    :func:`craft_rag_bench.paths.index_cache_dir`) unless ``use_cache`` is false."""
    folder = (Path(cache_dir) if cache_dir is not None else index_cache_dir()) / "embeddings"
    dim = encoder.dim
    shards: list[tuple[str, list[Passage]]] = [
        (dataset, list(group)) for dataset, group in groupby(passages, key=lambda p: p.dataset)
    ]
    results: list[Embeddings | None] = []
    keys: list[str] = []
    for _, group in shards:
        key = shard_key(encoder.model_id, group)
        keys.append(key)
        cached = _load_shard(folder / f"{key}.npy", len(group), dim) if use_cache else None
        results.append(cached)
    missing = sum(len(group) for (_, group), r in zip(shards, results, strict=True) if r is None)
    if missing:
        from tqdm import tqdm

        with tqdm(
            total=missing,
            desc="embedding passages",
            unit="psg",
            file=sys.stderr,
            disable=not show_progress,
        ) as bar:
            for i, (dataset, group) in enumerate(shards):
                if results[i] is not None:
                    continue
                array = encoder.encode([p.content for p in group], progress=bar)
                results[i] = array
                if use_cache:
                    meta: dict[str, object] = {
                        "model_id": encoder.model_id,
                        "dataset": dataset,
                        "count": len(group),
                        "first_id": group[0].id,
                        "last_id": group[-1].id,
                    }
                    _save_shard(folder, keys[i], array, meta)
    if not results:
        return np.empty((0, dim), dtype=np.float32)
    arrays = [r for r in results if r is not None]
    assert len(arrays) == len(results)
    return np.ascontiguousarray(np.concatenate(arrays, axis=0))
