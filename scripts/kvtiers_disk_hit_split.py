"""Where a disk-tier hit's TTFT goes: disk read + verify, injection, and the forward.

Usage: ``VLLM_ENABLE_V1_MULTIPROCESSING=0 nice -n 10 python scripts/kvtiers_disk_hit_split.py DIR``

One in-process engine (SmolLM2-135M, block 32, a 48-block pool) with ``CraftTierConnector``
over a disk-only tier (RAM tier off, so every tier hit is a disk read). N ~600-token prompts are
computed (saved to disk), a flood evicts them from the pool, the tier files are dropped from the
page cache (``POSIX_FADV_DONTNEED``), and the prompts are sent again: each is a disk hit of 18
blocks. Per request it reports the TTFT, the time inside the scheduler's
``get_num_new_matched_tokens`` (where the store reads and verifies each block file), inside the
worker's ``start_load_kv`` (the copy into the pool) and how many times the attention layers
called ``wait_for_layer_load`` during the request (the per-layer hook a layer-pipelined load
would need) and the time from the first layer's hook to the last one's (the forward a
layer-pipelined load could run under). The rest of the TTFT is the forward of the uncached
tail plus scheduling. Then the same prompts are recomputed (``skip_reading_prefix_cache``).
One JSON line on stdout.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

N, LEN, BLOCK = 4, 600, 32


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(LEN)]


def timed(
    obj: Any, name: str, acc: dict[str, float], counts: dict[str, int], marks: list[float]
) -> None:
    """Wrap ``obj.name`` so its wall time adds up in ``acc[name]``, its calls in ``counts`` and
    each call's start time in ``marks`` (when ``marks`` is given a list to fill)."""
    original: Callable[..., Any] = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        marks.append(start)
        try:
            return original(*args, **kwargs)
        finally:
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - start
            counts[name] = counts.get(name, 0) + 1

    setattr(obj, name, wrapper)


def drop_page_cache(folder: Path) -> int:
    dropped = 0
    for path in folder.iterdir():
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += 1
            finally:
                os.close(fd)
    return dropped


def main() -> None:
    disk_dir = Path(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from craft_rag.engine.cpu_dtype import default_dtype
    from craft_rag.engine.model import resolve_model
    from craft_rag.kvtiers.tier_settings import KVTierSettings

    disk_dir.mkdir(mode=0o700, exist_ok=True)
    tiers = KVTierSettings(ram_bytes=0, disk_bytes=1 << 30, disk_dir=disk_dir)
    llm = LLM(
        model=resolve_model(None),
        dtype=default_dtype(),
        enforce_eager=True,
        block_size=BLOCK,
        enable_prefix_caching=True,
        num_gpu_blocks_override=48,
        kv_cache_memory_bytes=256 << 20,
        max_model_len=1024,
        seed=0,
        disable_log_stats=True,
        kv_transfer_config=KVTransferConfig(**tiers.transfer_config()),
    )
    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
    worker = get_kv_transfer_group()
    acc: dict[str, float] = {}
    counts: dict[str, int] = {}
    layer_marks: list[float] = []
    timed(conn, "get_num_new_matched_tokens", acc, counts, [])
    timed(worker, "start_load_kv", acc, counts, [])
    timed(worker, "wait_for_layer_load", acc, counts, layer_marks)

    def run(tokens: list[int], scratch: bool = False) -> dict[str, Any]:
        params = SamplingParams(max_tokens=1, temperature=0.0, skip_reading_prefix_cache=scratch)
        acc.clear()
        counts.clear()
        layer_marks.clear()
        start = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
        ttft = time.perf_counter() - start
        return {
            "ttft_s": round(ttft, 4),
            "match_s": round(acc.get("get_num_new_matched_tokens", 0.0), 4),
            "inject_s": round(acc.get("start_load_kv", 0.0), 4),
            "layer_waits": counts.get("wait_for_layer_load", 0),
            # first to last layer's hook: the forward time a layer-pipelined load could hide in
            "layers_span_s": round(layer_marks[-1] - layer_marks[0], 4) if layer_marks else 0,
            "cached": out.num_cached_tokens,
            "tiers": (out.kv_transfer_params or {}).get("craft_tiers"),
        }

    run(prompt(999)[:64])  # warm-up
    for i in range(N):
        run(prompt(i))  # computed, saved to disk
    for i in range(4):
        run(prompt(500 + i))  # evict the prompts from the pool
    conn.store.flush()
    result: dict[str, Any] = {"dtype": default_dtype(), "files_dropped": drop_page_cache(disk_dir)}
    result["disk_hits"] = [run(prompt(i)) for i in range(N)]
    result["recompute"] = [run(prompt(i), scratch=True) for i in range(N)]
    result["layers"] = len(worker._layout.layer_names) if worker._layout else None
    llm.llm_engine.engine_core.shutdown()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
