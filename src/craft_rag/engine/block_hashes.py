"""Expected block hashes: the hashes vLLM gives a prompt's full KV blocks.

:class:`BlockHasher` computes the hashes vLLM will give a prompt's full KV blocks, the way
``vllm.v1.core.kv_cache_utils`` does: ``h_0 = H((NONE_HASH, tokens[0:B], extra))``,
``h_j = H((h_{j-1}, tokens[jB:(j+1)B], None))`` where ``H`` is the configured
``prefix_caching_hash_algo`` (default ``sha256`` over a pickle) and ``NONE_HASH = H(seed)``
(seed ``PYTHONHASHSEED`` if set, else ``"vllm-none-hash"``). KV events report hashes either
as those bytes or, when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is on (vLLM's default), as
their low 64 bits as an int; :meth:`BlockHasher.external` applies the same conversion, then
:func:`craft_rag.types.as_block_hash`, so expected and reported hashes compare equal.

The KV event sync (:mod:`craft_rag.engine.kv_events`) uses them to check a server's hashing;
the planners use them to key the CP-Tree by block.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from craft_rag.types import BlockHash, as_block_hash

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_INT_HASH_MASK = (1 << 64) - 1


def sha256_pickle(obj: Any) -> bytes:
    """vLLM's ``sha256`` prefix-caching hash: SHA-256 of the highest-protocol pickle."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """The block hash function for a ``prefix_caching_hash_algo`` name. ``sha256`` is
    implemented here; the others come from vLLM (``ImportError`` without it)."""
    if algo == "sha256":
        return sha256_pickle
    try:
        hashing: Any = importlib.import_module("vllm.utils.hashing")
    except ImportError as exc:
        msg = f"hash algo {algo!r} needs vllm installed: pip install 'craft-rag[cpu]'"
        raise ImportError(msg) from exc
    fn: Callable[[Any], bytes] = hashing.get_hash_fn_by_name(algo)
    return fn


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Computes vLLM's chained block hashes for a token sequence.

    Invariant: ``none_hash`` is the parent of the first block, exactly as the engine's
    ``kv_cache_utils.NONE_HASH``; ``int_hashes`` mirrors how the engine reports hashes in KV
    events. Cost: one hash of ``block_size`` token ids per full block.
    """

    block_size: int
    hash_fn: Callable[[Any], bytes]
    none_hash: bytes
    int_hashes: bool

    def __post_init__(self) -> None:
        if self.block_size < 1:
            msg = f"block_size must be >= 1, got {self.block_size}"
            raise ValueError(msg)

    @classmethod
    def for_algo(
        cls,
        block_size: int,
        algo: str = "sha256",
        *,
        int_hashes: bool = True,
        seed: str | None = None,
    ) -> BlockHasher:
        """A hasher built independently of a running engine. ``seed`` defaults to
        ``PYTHONHASHSEED`` or vLLM's fixed default (correct for cryptographic algos; xxhash
        engines use a random per-process seed unless ``PYTHONHASHSEED`` is set)."""
        fn = hash_function(algo)
        resolved = seed if seed is not None else os.environ.get("PYTHONHASHSEED")
        if resolved is None:
            resolved = DEFAULT_NONE_HASH_SEED
        return cls(block_size, fn, fn(resolved), int_hashes)

    @classmethod
    def from_engine(cls, vllm_config: Any) -> BlockHasher:
        """The hasher of an in-process engine: its hash block size and algorithm, the
        ``NONE_HASH`` it initialised, and the event hash format it publishes."""
        envs: Any = importlib.import_module("vllm.envs")
        kv_cache_utils: Any = importlib.import_module("vllm.v1.core.kv_cache_utils")
        cache = vllm_config.cache_config
        block_size = int(getattr(cache, "hash_block_size", None) or cache.block_size)
        algo = str(cache.prefix_caching_hash_algo)
        int_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
        # In-process engines initialised NONE_HASH in this interpreter; with a separate engine
        # core process it is unset here and derived from the seed as that process did.
        none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
        if none_hash is None:
            return cls.for_algo(block_size, algo, int_hashes=int_hashes)
        return cls(block_size, hash_function(algo), bytes(none_hash), int_hashes)

    def raw_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """Engine-internal hashes of every full block of ``token_ids`` (the partial last block
        has none). ``cache_salt`` is mixed into the first block as vLLM does."""
        out: list[bytes] = []
        parent = self.none_hash
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
            parent = self.hash_fn((parent, tuple(token_ids[start : start + size]), extra))
            out.append(parent)
        return out

    def external(self, raw: bytes) -> BlockHash:
        """``raw`` as KV events report it, normalised to a :data:`BlockHash`."""
        if self.int_hashes:
            return as_block_hash(int.from_bytes(raw, "big") & _INT_HASH_MASK)
        return as_block_hash(raw)

    def block_hashes(
        self, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[BlockHash]:
        """Hashes of the full blocks of ``token_ids`` as KV events will report them."""
        return [self.external(h) for h in self.raw_hashes(token_ids, cache_salt)]

    def per_chunk(
        self, hashes: Sequence[BlockHash], chunk_spans: Sequence[tuple[int, int]]
    ) -> list[list[BlockHash]]:
        """For each ``[start, end)`` chunk span, the hashes of the full blocks whose last token
        lies inside it (block ``j`` ends at token ``(j + 1) * block_size - 1``). O(blocks)."""
        out: list[list[BlockHash]] = []
        size = self.block_size
        for start, end in chunk_spans:
            first = start // size  # block j ends inside iff start < (j+1)*size <= end
            last = end // size  # exclusive
            out.append([hashes[j] for j in range(first, min(last, len(hashes)))])
        return out
