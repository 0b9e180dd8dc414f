"""llama_index.llms.craft_vllm's public names are pinned (moved from the former single package's
query-engine tests)."""

from __future__ import annotations


def test_public_api_is_pinned() -> None:
    import llama_index.llms.craft_vllm as llms

    assert set(llms.__all__) == {
        "CONDENSE_METADATA_KEY",
        "REUSE_KEY",
        "REUSE_METADATA_KEY",
        "REUSE_REPORTS_KEY",
        "SKIPPED_KEY",
        "CraftChatEngine",
        "CraftSynthesizer",
        "CraftVLLM",
        "ReuseCollector",
        "as_craft_chat_engine",
        "collect_reuse",
        "craft_query_engine",
    }
