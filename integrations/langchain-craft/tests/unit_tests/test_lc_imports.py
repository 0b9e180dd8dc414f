"""The public API is pinned: adding or removing a name is a deliberate change to this list."""

import langchain_craft

EXPECTED_ALL = [
    "CRAFT_PLAN_EVENT",
    "ChatCraftVLLM",
    "CraftContext",
    "CraftConversation",
    "CraftDocuments",
    "CraftRAGPrompt",
    "CraftReorder",
    "CraftRetriever",
    "CraftVLLM",
    "craft_context",
    "craft_minilm_embeddings",
]


def test_all_imports() -> None:
    assert sorted(langchain_craft.__all__) == sorted(EXPECTED_ALL)
    for name in EXPECTED_ALL:
        assert getattr(langchain_craft, name) is not None


def test_import_does_not_start_or_import_the_engine() -> None:
    import subprocess
    import sys

    code = "import langchain_craft, sys; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
