"""The engine's finished request as LangChain metadata: the reuse report, token usage and the
exact prompt sent, in the shape both models (and ``CraftConversation``) report them.

Pure conversions of ``craft_rag.engine`` result objects; nothing here touches the engine.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from langchain_core.messages.ai import InputTokenDetails, UsageMetadata

if TYPE_CHECKING:
    from craft_rag.engine import GenerationResult, ReuseReport

PROMPT_KEY = "craft_prompt"
"""``response_metadata``/``generation_info`` key of the exact prompt sent: ``{"text": ...,
"token_ids": [...]}`` (``text``: the ids decoded with control tokens spelled out; ``None``
when the engine's tokenizer cannot decode)."""


def report_dict(result: GenerationResult) -> dict[str, Any]:
    """The engine's ``ReuseReport`` as JSON-ready data, plus ``cached_fraction``."""
    return reuse_dict(result.report)


def reuse_dict(report: ReuseReport) -> dict[str, Any]:
    """A ``ReuseReport`` as JSON-ready data, plus ``cached_fraction``."""
    data = asdict(report)
    for key, value in data.items():
        if isinstance(value, tuple):
            data[key] = list(value)
    data["cached_fraction"] = report.cached_fraction
    return data


def usage_metadata(result: GenerationResult) -> UsageMetadata:
    """Token usage; ``input_token_details.cache_read`` is vLLM's ``num_cached_tokens``."""
    report = result.report
    return UsageMetadata(
        input_tokens=report.prompt_tokens,
        output_tokens=report.output_tokens,
        total_tokens=report.prompt_tokens + report.output_tokens,
        input_token_details=InputTokenDetails(cache_read=report.cached_tokens),
    )


def final_metadata(
    result: GenerationResult, model_name: str, prompt: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``response_metadata`` / ``generation_info`` of a finished request: the reuse report
    under ``craft`` and, given, the prompt sent under ``craft_prompt``."""
    metadata = {
        "model_name": model_name,
        "finish_reason": result.finish_reason,
        "craft": report_dict(result),
    }
    if prompt is not None:
        metadata[PROMPT_KEY] = prompt
    return metadata
