"""Chunk-caches over a server (``CraftEngine(server=url,
settings=EngineSettings(chunk_cache=...))``) against the fake server: the chunk spans leave in the
OpenAI body's ``kv_transfer_params`` (vLLM's server field; ``extra_args`` would be ignored there)
under a request-scoped ``cache_salt``, and the connector's ``craft_reuse`` counts on the stream's
usage event reach the ``ReuseReport``; counts that do not add up, or none, read as no chunk-cache
reuse (with one warning naming the fix). The real server runs in
tests/server/test_real_chunk_cache_server.py."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from fake_server import FORMAT, FakeServer, chunks, running
from test_server_backend import model_dir  # noqa: F401  (fixture)

from craft_rag.engine import ChunkCacheSettings, CraftEngine, EngineSettings, ServerSettings
from craft_rag.engine.results import SamplingRequest, TokensRequest
from craft_rag.kvtiers.approx_params import is_request_scoped
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.tokenizer import HashingTokenizer


def _engine(url: str, model_dir: Path, chunk_cache: ChunkCacheSettings | None) -> CraftEngine:  # noqa: F811
    return CraftEngine(
        EngineSettings(model=model_dir, chunk_cache=chunk_cache),
        CraftPlanner(PlannerConfig(policy="tree")),
        tokenizer=HashingTokenizer(),
        prompt_format=FORMAT,
        server=ServerSettings(url, kv_events=False, backoff=0.01),
    )


def _connector(body: dict[str, Any]) -> dict[str, Any] | None:
    """What the chunk-cache connector answers: counts for a request with chunk spans (half of
    the prompt fixed, the rest computed), nothing otherwise."""
    if "craft_approx" not in (body.get("kv_transfer_params") or {}):
        return None
    n = len(body["prompt"])
    return {"craft_reuse": {"exact": 0, "fixed": n // 2, "recomputed": 0,
                            "computed": n - n // 2, "refused": None}}


def _cold_seed(fake: FakeServer, model_dir: Path) -> tuple[Any, dict[str, Any]]:  # noqa: F811
    """One cold RAG request with ``seed_cold`` on (sent as chunk spans): its report and body."""
    with running(fake) as url:
        engine = _engine(url, model_dir, ChunkCacheSettings(seed_cold=True))
        try:
            report = engine.generate(chunks(), "what is w1x3?", max_tokens=2).report
        finally:
            engine.close()
    return report, fake.bodies[-1]


def test_spans_travel_as_kv_transfer_params_and_counts_come_back(model_dir: Path) -> None:  # noqa: F811
    report, body = _cold_seed(FakeServer(kv_transfer_params=_connector), model_dir)
    assert "extra_args" not in body  # vLLM's server ignores unknown fields: nothing sent there
    params = body["kv_transfer_params"]
    assert params["craft_approx"]["spans"], params
    assert is_request_scoped(body["cache_salt"])  # the isolation rule's salt, as the cache_salt
    n = report.prompt_tokens
    assert (report.approximate, report.fixed_tokens, report.computed_tokens) == (
        True, n // 2, n - n // 2,
    )
    assert report.exact_reused_tokens == 0 and report.chunk_cache_refused is None


@pytest.mark.parametrize(
    "params",
    [
        None,  # a server without the connector (or without the streaming patch)
        {"craft_reuse": {"exact": 0, "fixed": 1, "recomputed": 0, "computed": 0,
                         "refused": None}},  # does not add up to the prompt
        {"craft_reuse": {"exact": 0, "fixed": "1"}},
    ],
)
def test_missing_or_bad_counts_read_as_no_reuse_with_one_warning(
    model_dir: Path,  # noqa: F811
    params: object,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, "craft_rag.engine.backends.server.backend"):
        report, _body = _cold_seed(FakeServer(kv_transfer_params=params), model_dir)
    assert not report.approximate and report.fixed_tokens == 0
    assert report.exact_reused_tokens is None and report.computed_tokens is None
    warned = [r.getMessage() for r in caplog.records if "chunk-cache counts" in r.getMessage()]
    assert len(warned) == 1 and "craft-rag serve --chunk-cache" in warned[0], warned


def test_extra_args_map_to_the_servers_fields(model_dir: Path) -> None:  # noqa: F811
    fake = FakeServer()
    extra = {"extra_args": {"kv_transfer_params": {"a": 1}, "tag": "x"},
             "kv_transfer_params": {"b": 2}, "repetition_penalty": 1.1}
    with running(fake) as url:
        engine = _engine(url, model_dir, None)
        try:
            engine.submit(TokensRequest(
                [5, 6, 7, 8, 9], sampling=SamplingRequest(max_tokens=1, extra=extra),
            )).result()
        finally:
            engine.close()
    body = fake.bodies[-1]
    assert "extra_args" not in body
    assert body["kv_transfer_params"] == {"a": 1, "b": 2}
    assert body["vllm_xargs"] == {"tag": "x"} and body["repetition_penalty"] == 1.1


def test_without_chunk_cache_nothing_is_sent(model_dir: Path) -> None:  # noqa: F811
    fake = FakeServer(kv_transfer_params=_connector)
    with running(fake) as url:
        engine = _engine(url, model_dir, None)
        try:
            report = engine.generate(chunks(), "what is w1x3?", max_tokens=2).report
        finally:
            engine.close()
    assert "kv_transfer_params" not in fake.bodies[-1] and "cache_salt" not in fake.bodies[-1]
    assert report.exact_reused_tokens is None and not report.approximate
