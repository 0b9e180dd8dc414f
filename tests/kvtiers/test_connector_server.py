"""CraftTierConnector under ``craft-rag serve`` (vLLM's OpenAI server), loaded by module path.

With vLLM's CPU default (``VLLM_ENABLE_V1_MULTIPROCESSING`` unset) the server runs the
multiprocess executor: the scheduler (EngineCore) and the worker are two processes and the KV
bytes travel in vLLM's own step messages; with it set to 0 (as the test environment may) the
worker runs inside the EngineCore process. Both were seen to work. A prompt
evicted from the pool comes back from the RAM tier with the same greedy text, and the response
carries the connector's ``kv_transfer_params`` (read back as a ``ReuseReport`` reads them). The
server is configured as ``craft-rag serve --kv-tier-*`` configures it (``ServeConfig.kv_tiers``),
so it runs through :mod:`craft_rag.kvtiers.api_server`: a streamed completion's final usage chunk
carries the same counts.

The same server then serves a ``CraftEngine(server=...)`` (one server start for the whole
file: CI time). Over HTTP, as in-process (tests/kvtiers/test_planner_tiers_vllm.py): the
connector's residency events (medium ``CPU``) reach the engine's KV event subscriber, so a
chunk-prefix the pool evicted stays in the CP-Tree, its nodes move to the RAM tier (what the
router's cost reads), the next plan puts it first, and the streamed request's ``ReuseReport``
says how many of its tokens came from the RAM tier; a ``generate_tokens`` call of a prompt only
the RAM tier holds reports exactly its loadable tokens as RAM tokens.
"""

from __future__ import annotations

import json
import random
import socket
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.engine

LEN, BLOCK = 600, 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(LEN)]


def test_served_prompt_comes_back_from_the_tiers(tmp_path: Path) -> None:
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("vllm")
    from craft_rag.engine.backends.server.serve import (
        ServeConfig,
        start_server,
        stop_server,
        wait_ready,
    )
    from craft_rag.engine.model import resolve_model
    from craft_rag.kvtiers.tier_settings import KVTierSettings
    from craft_rag.kvtiers.tier_tokens import tier_tokens_of

    tiers = KVTierSettings(ram_bytes=1 << 30, disk_bytes=1 << 30, disk_dir=tmp_path / "tiers")
    port = _free_port()
    config = ServeConfig(
        model=resolve_model(None), port=port, kv_events_port=_free_port(), max_model_len=1024,
        kv_cache_memory_bytes=256 << 20, kv_tiers=tiers,
        extra_args=("--num-gpu-blocks-override", "48"),
    )
    with tempfile.TemporaryFile() as log:
        proc = start_server(config, log=log)
        try:
            wait_ready(config.url, timeout=600, alive=lambda: proc.poll() is None)

            def complete(tokens: list[int]) -> dict[str, object]:
                body = {"model": config.model_name, "prompt": tokens, "max_tokens": 8,
                        "temperature": 0}
                answer = httpx.post(f"{config.url}/v1/completions", json=body, timeout=600)
                answer.raise_for_status()
                result: dict[str, object] = answer.json()
                return result

            def stream(tokens: list[int]) -> list[dict[str, Any]]:
                body = {"model": config.model_name, "prompt": tokens, "max_tokens": 2,
                        "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                with httpx.stream("POST", f"{config.url}/v1/completions", json=body,
                                  timeout=600) as answer:
                    answer.raise_for_status()
                    return [json.loads(line[5:]) for line in answer.iter_lines()
                            if line.startswith("data:") and "[DONE]" not in line]

            first = complete(_prompt(1))
            streamed = stream(_prompt(1))  # a pool hit: no tier tokens, counts still sent
            for seed in (500, 501, 502):  # evict it from the 48-block pool
                complete(_prompt(seed))
            again = complete(_prompt(1))
            engine_run = _engine_over_the_server(config.url, config.events_port)
        except BaseException:
            log.seek(0)
            print(log.read()[-4000:].decode(errors="replace"))
            raise
        finally:
            stop_server(proc)
    loadable = (LEN - 1) // BLOCK * BLOCK
    assert first["kv_transfer_params"] == {"craft_tiers": {"ram_tokens": 0, "disk_tokens": 0}}
    assert again["kv_transfer_params"] == {
        "craft_tiers": {"ram_tokens": loadable, "disk_tokens": 0}
    }
    assert tier_tokens_of(again["kv_transfer_params"], maximum=LEN) == (loadable, 0)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == loadable  # type: ignore[index]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]  # type: ignore[index]
    # streamed: the counts ride on the final usage chunk only
    assert [e.get("kv_transfer_params") for e in streamed[:-1]] == [None] * (len(streamed) - 1)
    assert streamed[-1]["choices"] == [] and streamed[-1]["usage"]["prompt_tokens"] == LEN
    assert streamed[-1]["kv_transfer_params"] == {
        "craft_tiers": {"ram_tokens": 0, "disk_tokens": 0}
    }
    _check_engine_run(engine_run, loadable)


def _engine_over_the_server(url: str, events_port: int) -> dict[str, Any]:
    """The planner-sees-the-tiers scenario through ``CraftEngine(server=url)``; what the
    assertions need, gathered while the server runs."""
    from tier_flood import flood_until_evicted, make_chunks

    from craft_rag.engine import CraftEngine, ServerSettings

    engine = CraftEngine(server=ServerSettings(url, kv_events=events_port))
    try:
        sync, tree = engine.kv_events, engine.planner.prefix_tree
        assert sync is not None, "no KV event subscription over the server"
        chunks = make_chunks(4, repeat=4, prefix="keep")
        keys = tuple(c.key for c in chunks)
        first = engine.generate(chunks, "Which?", max_tokens=1)
        hashes, dropped = flood_until_evicted(engine, keys, timeout=30)
        sync.wait_quiet(quiet=0.5, timeout=10)
        out: dict[str, Any] = {
            "first_order": first.report.chunk_order,
            "keys": keys,
            "hashes": hashes,
            "dropped": dropped,
            "held": sync.residency.held,
            "media": {m for h in hashes for m in sync.residency.media(h)},
            "kept": keys in tree.iter_paths(),
            "tiers": [n.location.tier for n in tree.match(keys).nodes if n.location],
        }
        new = make_chunks(1, repeat=4, prefix="new")
        *_, last = engine.stream(new + chunks[::-1], "Which one?", max_tokens=1)
        assert last.result is not None
        out["again"] = last.result.report
        out["tokens"] = engine.generate_tokens(_prompt(1), max_tokens=1).report
        return out
    finally:
        engine.close()


def _check_engine_run(run: dict[str, Any], loadable: int) -> None:
    assert run["first_order"] == run["keys"] and run["hashes"]
    assert run["dropped"], "the flood did not evict the first prompt's blocks"
    assert run["held"] > 0  # pool removals the RAM tier's events made the subscriber hold back
    assert "CPU" in run["media"]  # the connector's events reached the client with their medium
    assert run["kept"]  # without them the pool's removals would have dropped the path
    assert "CPU" in run["tiers"], run["tiers"]  # nodes moved to the RAM tier (the router's cost)
    report = run["again"]  # streamed through engine.stream
    assert report.predicted_chunks == 4 and report.chunk_order[:4] == run["keys"]
    assert report.tier_ram_tokens > 0 and report.tier_ram_tokens % BLOCK == 0, report
    assert report.tier_ram_tokens + report.pool_tokens == report.cached_tokens
    assert report.reused_chunks >= 3
    tokens = run["tokens"]  # the raw prompt: only the RAM tier still holds it
    assert (tokens.tier_ram_tokens, tokens.tier_disk_tokens, tokens.pool_tokens) == (
        loadable, 0, 0,
    ), tokens
