"""``craft_rag.validation.registry_by_name``: the policy registries are keyed by each class's own
``name`` (the other checks of the module are tested with the settings that use them)."""

from __future__ import annotations

import pytest

from craft_rag.ordering import ORDERING_POLICIES, get_policy
from craft_rag.promotion import PROMOTION_RULES
from craft_rag.routing.policies import ROUTING_POLICIES
from craft_rag.validation import from_registry, registry_by_name


class _A:
    name = "a"


class _B:
    name = "b"


class _OtherA:
    name = "a"


def test_each_class_under_its_own_name_in_order() -> None:
    registry = registry_by_name(_B, _A)
    assert list(registry.items()) == [("b", _B), ("a", _A)]
    assert isinstance(from_registry(registry, "a", "letter"), _A)
    with pytest.raises(ValueError, match=r"unknown letter 'c'; choose one of \['a', 'b'\]"):
        from_registry(registry, "c", "letter")


def test_two_classes_of_one_name_are_refused() -> None:
    with pytest.raises(ValueError, match="_OtherA and _A share 'a'"):
        registry_by_name(_A, _OtherA)


@pytest.mark.parametrize("registry", [ORDERING_POLICIES, ROUTING_POLICIES, PROMOTION_RULES])
def test_the_library_registries_name_what_their_objects_report(registry: object) -> None:
    assert isinstance(registry, dict)
    assert registry
    for key, factory in registry.items():
        assert factory().name == key


def test_registries_keep_their_names() -> None:
    assert list(ORDERING_POLICIES) == ["retriever", "frequency", "tree"]
    assert list(ROUTING_POLICIES) == [
        "round_robin", "least_loaded", "prefix_fixed_order", "craft_joint",
        "prefix_blocks", "prefix_craft_order",
    ]
    assert list(PROMOTION_RULES) == ["threshold", "served"]
    assert get_policy("tree").name == "tree"
