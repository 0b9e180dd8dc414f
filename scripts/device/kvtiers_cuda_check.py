"""Check craft_rag.kvtiers.layout_cuda on a CUDA GPU with torch alone (no vLLM).

For every vLLM 0.32 KV layout and dtype: builds per-layer KV views the way vLLM does (random
data), round-trips 64 random blocks (extract -> inject into other slots) and checks that the
whole cache equals the expected bytes (targets replaced, everything else untouched), also
through a reused staging buffer; then times extract (device->host into pinned memory) and
inject (host->device, from the staging buffer and from bytes) for a 1-block and a 32-block
contiguous chunk-prefix (median of repeats, wall clock around torch.cuda.synchronize), next to
a raw pinned copy of the same size as the ceiling.

Run from the repository root:  python3 scripts/device/kvtiers_cuda_check.py
Prints one JSON object; writes it to $OUT/kvtiers_cuda.json when OUT is set. Exit status 1 if a
round trip differs. Without CUDA it runs a small CPU configuration (timings then say "cpu" and
are not GPU numbers). It loads layout_cuda.py by file path: the module imports only torch and
the standard library, and the package's __init__ would pull more.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

MODULE = Path(__file__).resolve().parents[2] / "src" / "craft_rag" / "kvtiers" / "layout_cuda.py"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TIME_BUDGET_S = 150.0  # stop starting new configurations after this (target: < 3 min)


def load_layout_cuda() -> ModuleType:
    spec = importlib.util.spec_from_file_location("craft_rag_layout_cuda", MODULE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_s(fn: Any, device: torch.device, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check_one(
    lc: ModuleType,
    name: str,
    dtype: torch.dtype,
    args: argparse.Namespace,
    device: torch.device,
    rng: random.Random,
) -> dict[str, Any]:
    caches = lc.allocate_kv_caches(
        name,
        num_layers=args.layers,
        num_blocks=args.blocks,
        num_kv_heads=args.heads,
        block_size=args.block_size,
        head_size=args.head_size,
        dtype=dtype,
        device=device,
    )
    for kv in caches.values():
        kv.normal_()
    layout = lc.layout_of(caches, name)
    inferred = lc.layout_of(caches).layout
    half = args.blocks // 2
    src = rng.sample(range(half), args.roundtrip_blocks)
    dst = rng.sample(range(half, args.blocks), args.roundtrip_blocks)
    snapshot = {n: kv.clone() for n, kv in caches.items()}
    staged = lc.extract_blocks(caches, src, layout)
    payloads = staged.payloads()
    lc.inject_blocks(caches, dst, payloads, layout).synchronize()
    sync(device)
    ok = True
    for n, kv in caches.items():
        expected = snapshot[n].clone()
        expected[dst] = snapshot[n][src]
        ok &= bool(torch.equal(kv.view(torch.uint8), expected.view(torch.uint8)))
    back = lc.extract_blocks(caches, dst, layout).payloads()
    ok &= back == payloads
    # the staging buffer itself, reused without bytes, into a third set of slots
    used = set(src) | set(dst)
    third = [b for b in range(args.blocks) if b not in used][: args.roundtrip_blocks]
    lc.inject_blocks(caches, third, staged, layout).synchronize()
    ok &= lc.extract_blocks(caches, third, layout).payloads() == payloads
    del snapshot

    timings = {
        f"{n}_block": time_chunk(lc, caches, layout, n, device, rng, args.repeats) for n in (1, 32)
    }
    return {
        "layout": name,
        "dtype": str(dtype).removeprefix("torch."),
        "fused": layout.fused,
        "inferred_layout": inferred,
        "block_bytes": layout.block_bytes,
        "fingerprint": layout.fingerprint(),
        "roundtrip_blocks": args.roundtrip_blocks,
        "roundtrip_ok": ok and inferred == name,
        "timings": timings,
    }


def time_chunk(
    lc: ModuleType,
    caches: dict[str, torch.Tensor],
    layout: Any,
    n_blocks: int,
    device: torch.device,
    rng: random.Random,
    repeats: int,
) -> dict[str, float]:
    """Median times of extract and inject of one contiguous chunk-prefix of ``n_blocks``."""
    start = rng.randrange(0, layout.num_blocks - n_blocks)
    ids = list(range(start, start + n_blocks))
    nbytes = n_blocks * layout.block_bytes
    staged = lc.extract_blocks(caches, ids, layout)
    blobs = staged.payloads()
    ops = {
        "extract": lambda: lc.extract_blocks(caches, ids, layout).synchronize(),
        "inject_staged": lambda: lc.inject_blocks(caches, ids, staged, layout).synchronize(),
        "inject_bytes": lambda: lc.inject_blocks(caches, ids, blobs, layout).synchronize(),
    }
    out: dict[str, float] = {"bytes": nbytes}
    for op, fn in ops.items():
        t = median_s(fn, device, repeats)
        out[f"{op}_ms"] = round(t * 1e3, 4)
        out[f"{op}_GBps"] = round(nbytes / t / 1e9, 3)
    return out


def raw_copy_ceiling(nbytes: int, device: torch.device, repeats: int) -> dict[str, float]:
    """One pinned host<->device copy of ``nbytes``: what a single memcpy reaches here."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    d2h = median_s(lambda: host.copy_(dev, non_blocking=True), device, repeats)
    h2d = median_s(lambda: dev.copy_(host, non_blocking=True), device, repeats)
    return {
        "bytes": nbytes,
        "d2h_GBps": round(nbytes / d2h / 1e9, 3),
        "h2d_GBps": round(nbytes / h2d / 1e9, 3),
    }


def main() -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=28 if cuda else 4)
    parser.add_argument("--blocks", type=int, default=512 if cuda else 256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8 if cuda else 2)
    parser.add_argument("--head-size", type=int, default=128 if cuda else 64)
    parser.add_argument("--roundtrip-blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20 if cuda else 5)
    parser.add_argument("--layouts", default="all", help="comma-separated, or all")
    parser.add_argument("--dtypes", default="bf16,fp16")
    args = parser.parse_args()
    t_start = time.perf_counter()
    lc = load_layout_cuda()
    assert "vllm" not in sys.modules
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)  # a shared CPU box: fewer threads, less noise
    layouts = list(lc.KV_CACHE_LAYOUTS) if args.layouts == "all" else args.layouts.split(",")
    rng = random.Random(0)
    torch.manual_seed(0)
    results, skipped = [], []
    for name in layouts:
        for dname in args.dtypes.split(","):
            if time.perf_counter() - t_start > TIME_BUDGET_S:
                skipped.append(f"{name}/{dname}")
                continue
            results.append(check_one(lc, name, DTYPES[dname], args, device, rng))
            if cuda:
                torch.cuda.empty_cache()
    block_bytes = results[0]["block_bytes"] if results else 0
    summary = {
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.machine()})",
        "timings_are": "GPU" if cuda else "cpu: NOT GPU numbers (no CUDA here)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "config": vars(args),
        "raw_copy_ceiling_32_blocks": raw_copy_ceiling(32 * block_bytes, device, args.repeats)
        if block_bytes
        else None,
        "results": results,
        "skipped": skipped,
        "all_ok": bool(results) and all(r["roundtrip_ok"] for r in results) and not skipped,
        "elapsed_s": round(time.perf_counter() - t_start, 2),
    }
    text = json.dumps(summary, indent=1)
    print(text)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "kvtiers_cuda.json").write_text(text + "\n")
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
