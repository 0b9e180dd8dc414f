"""The public API is pinned: adding or removing a name is a deliberate change to this list."""

import langchain_craft

EXPECTED_ALL = [
    "CRAFT_PLAN_EVENT",
    "CraftDocuments",
    "CraftReorder",
    "CraftRetriever",
]


def test_all_imports() -> None:
    assert sorted(langchain_craft.__all__) == sorted(EXPECTED_ALL)
    for name in EXPECTED_ALL:
        assert getattr(langchain_craft, name) is not None
