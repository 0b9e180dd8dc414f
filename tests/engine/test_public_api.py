"""The engine package's public names are pinned, and importing it stays cheap."""

from __future__ import annotations

import subprocess
import sys

import craft_rag.engine as engine_pkg

EXPECTED = {
    "condense_off_reason",
    "local_model_folder",
    "CONDENSE_INSTRUCTION",
    "DEFAULT_CONDENSE_MAX_TOKENS",
    "DEFAULT_HISTORY_BUDGET",
    "SAMPLING_KEYWORDS",
    "BlockHasher",
    "ChatTurn",
    "Condensed",
    "ConversationPrompts",
    "CraftEngine",
    "EngineFailure",
    "EngineRequest",
    "EngineSettings",
    "EngineStartError",
    "GenerationResult",
    "HistoryBudget",
    "APPEND_ONLY",
    "DEFAULT_TURN_LAYOUT",
    "LayoutChoice",
    "TurnCostModel",
    "TurnLayoutPolicy",
    "KVEventSync",
    "MessagesRequest",
    "PreparedModel",
    "RagRequest",
    "RenderedTurn",
    "RequestCancelled",
    "RequestHandle",
    "RoutedEngine",
    "ChunkCacheSettings",
    "ReuseReport",
    "SamplingRequest",
    "ServerError",
    "ServerRejected",
    "ServerSettings",
    "ServerUnavailable",
    "SpeculativePrefill",
    "IVFStagedSearch",
    "PipelineReport",
    "StreamChunk",
    "acondense",
    "condense",
    "TokensRequest",
    "derive_chat_format",
    "prepare_default_model",
    "resolve_model",
    "reused_chunk_count",
    "validate_cache_salt",
}


def test_all_is_pinned() -> None:
    assert set(engine_pkg.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(engine_pkg, name) is not None


def test_import_loads_no_heavy_framework() -> None:
    code = (
        "import sys, craft_rag.engine, craft_rag.engine.cli_commands; "
        "print(sorted(m for m in ('vllm', 'torch', 'transformers', 'zmq') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONPATH": ":".join(sys.path)},
    ).stdout.strip()
    assert out == "[]"
