"""llama_index.postprocessor.craft's public names are pinned (moved from the former single
package's query-engine tests). ``CraftRetriever`` moved to llama-index-retrievers-craft (still
importable from here when installed); ``split_nodes``/``SplitNodes``/``chunk_for_node`` became
public for the LLM distribution, which imports the postprocessor only through this root."""

from __future__ import annotations

import pytest


def test_public_api_is_pinned() -> None:
    import llama_index.postprocessor.craft as pkg

    assert set(pkg.__all__) == {
        "COMMIT_MODES",
        "KEY_SOURCES",
        "CommitMode",
        "CraftCommitEvent",
        "CraftReorderEndEvent",
        "CraftReorderPostprocessor",
        "CraftReorderResult",
        "CraftReorderStartEvent",
        "KeySource",
        "SplitNodes",
        "chunk_for_node",
        "default_key_source",
        "split_nodes",
    }
    for name in pkg.__all__:
        assert getattr(pkg, name) is not None


def test_unknown_names_are_attribute_errors() -> None:
    import llama_index.postprocessor.craft as pkg

    with pytest.raises(AttributeError, match="no attribute 'CraftRetrieverr'"):
        _ = pkg.CraftRetrieverr
