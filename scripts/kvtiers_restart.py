"""Warm restart of the KV disk tier under ``craft-rag serve``: cached tokens before vs after.

Usage (from the repository root; servers take 1-2 minutes to start on a small CPU):

    nice -n 10 .venv/bin/python scripts/kvtiers_restart.py --trace squad_60.jsonl \\
        --requests 50 [--stop sigterm|sigkill] [--no-write-through] [--out restart.json]

One server with a fresh private disk tier folder (removed at the end unless ``--keep-dir``):
pass 1 sends each request once (cold: computes and stores its blocks), pass 2 repeats them
("before": what a running server caches for a repeated request). The server is then stopped
(``sigterm``: a SIGTERM to its PID, the clean path that closes the tier store; ``sigkill``: the
whole process group is killed, a crash, where only write-through saved anything), a new server
starts on the same folder, and pass 3 repeats the requests again ("after"). Prints one JSON
object: cached tokens per pass, the after/before ratio (target >= 0.9), disk-tier tokens in
pass 3, and how many greedy outputs match pass 2's.

Prompts are the trace requests' chunks in retriever order, then the question, as plain text
(``/v1/completions``, non-streaming, so each reply carries the connector's tier counts).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompt_text(request: Any) -> str:
    context = "\n\n".join(chunk.text for chunk in request.chunks)
    return f"{context}\n\nQuestion: {request.query}\nAnswer:"


def run_pass(url: str, model: str, prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
    """One non-streaming greedy completion per prompt, in order; what each reply reports."""
    import httpx

    from craft_rag.kvtiers.tier_tokens import tier_tokens_of

    rows = []
    for text in prompts:
        body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0}
        start = time.perf_counter()
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        reply.raise_for_status()
        data = reply.json()
        usage = data["usage"]
        prompt_tokens = int(usage["prompt_tokens"])
        ram, disk = tier_tokens_of(data.get("kv_transfer_params"), maximum=prompt_tokens)
        rows.append(
            {
                "prompt_tokens": prompt_tokens,
                "cached_tokens": int(
                    (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                ),
                "ram_tokens": ram,
                "disk_tokens": disk,
                "text": data["choices"][0]["text"],
                "seconds": time.perf_counter() - start,
            }
        )
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "requests": len(rows),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "cached_tokens": sum(r["cached_tokens"] for r in rows),
        "ram_tokens": sum(r["ram_tokens"] for r in rows),
        "disk_tokens": sum(r["disk_tokens"] for r in rows),
        "mean_request_s": round(sum(r["seconds"] for r in rows) / max(len(rows), 1), 3),
    }


def start(argv: list[str], env: dict[str, str], log: Any, url: str) -> tuple[Any, float]:
    from craft_rag.engine.backends.server.serve import wait_ready

    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        waited = wait_ready(url, timeout=900, alive=lambda: proc.poll() is None)
    except BaseException:
        kill_group(proc)
        raise
    return proc, waited


def kill_group(proc: Any) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True, help="a craft-rag trace (JSONL)")
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--stop", choices=("sigterm", "sigkill"), default="sigterm")
    parser.add_argument("--write-through", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--ram-bytes", type=int, default=1 << 30)
    parser.add_argument("--disk-bytes", type=int, default=4 << 30)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--keep-dir", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    from craft_rag.engine.backends.server.serve import ServeConfig, server_command, server_env
    from craft_rag.engine.model import resolve_model
    from craft_rag.kvtiers.tier_settings import KVTierSettings
    from craft_rag.trace import read_trace

    requests = read_trace(args.trace, limit=args.requests)
    prompts = [prompt_text(r) for r in requests]
    root = Path(tempfile.mkdtemp(prefix="kvtiers-restart-"))
    tiers = KVTierSettings(
        ram_bytes=args.ram_bytes,
        disk_bytes=args.disk_bytes,
        disk_dir=root / "tiers",
        disk_write_through=args.write_through,
    )
    config = ServeConfig(
        model=str(resolve_model(None)),
        port=free_port(),
        kv_events_port=free_port(),
        max_model_len=4096,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_tiers=tiers,
    )
    command, env = server_command(config), server_env(config)
    result: dict[str, Any] = {
        "trace": str(args.trace),
        "stop": args.stop,
        "write_through": args.write_through,
        "ram_bytes": args.ram_bytes,
        "disk_bytes": args.disk_bytes,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "dtype": config.dtype,
        "max_tokens": args.max_tokens,
    }
    with open(root / "server.log", "wb") as log:
        proc, result["start1_s"] = start(command, env, log, config.url)
        try:
            cold = run_pass(config.url, config.model_name, prompts, args.max_tokens)
            before = run_pass(config.url, config.model_name, prompts, args.max_tokens)
            stop_start = time.perf_counter()
            if args.stop == "sigterm":
                proc.send_signal(signal.SIGTERM)
                result["exit_code"] = proc.wait(timeout=300)
            else:
                kill_group(proc)
            result["stop_s"] = round(time.perf_counter() - stop_start, 1)
        finally:
            kill_group(proc)
        files = list((root / "tiers").glob("*.kv"))
        result["files_after_stop"] = len(files)
        result["file_bytes_after_stop"] = sum(f.stat().st_size for f in files)
        proc, result["start2_s"] = start(command, env, log, config.url)
        try:
            after = run_pass(config.url, config.model_name, prompts, args.max_tokens)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=300)
        finally:
            kill_group(proc)
    result["cold"], result["before"], result["after"] = map(summary, (cold, before, after))
    got, had = result["after"]["cached_tokens"], result["before"]["cached_tokens"]
    result["ratio"] = round(got / had, 4) if had else None
    result["target_met"] = None if not had else got / had >= 0.9
    result["same_text"] = sum(a["text"] == b["text"] for a, b in zip(after, before, strict=True))
    result["per_request_ratio_min"] = min(
        (
            a["cached_tokens"] / b["cached_tokens"]
            for a, b in zip(after, before, strict=True)
            if b["cached_tokens"]
        ),
        default=None,
    )
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    if not args.keep_dir:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"kept {root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
