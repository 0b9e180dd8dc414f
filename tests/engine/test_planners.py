"""Salt namespaces (one planner per cache salt), checks on caller-made plans, and the engine's
conversation bound (one default per bound)."""

from __future__ import annotations

import random

import pytest

from craft_rag.conversation import DEFAULT_MAX_CONVERSATIONS
from craft_rag.engine import conversation_prompts
from craft_rag.engine.engine import CraftEngine
from craft_rag.engine.planners import (
    ENGINE_MAX_CONVERSATIONS,
    CacheSalt,
    PlannerNamespaces,
    bound_conversations,
    check_plan,
    default_planner,
    validate_cache_salt,
)
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.testing import FAKE_FORMAT, FakeBackend, HashingTokenizer, make_chunks
from craft_rag.tree import KVLocation
from craft_rag.types import BlockHash


def test_validate_cache_salt_follows_vllms_rules() -> None:
    assert validate_cache_salt(None) is None
    assert validate_cache_salt("tenant-a") == "tenant-a"
    assert validate_cache_salt("x" * 128) == "x" * 128
    for bad in ("", "a/b", "a@b", "a\\b", "a\x00", "x" * 129, 7, b"salt"):
        with pytest.raises(ValueError, match="cache_salt"):
            validate_cache_salt(bad)


def test_salted_planners_are_made_like_the_default_and_lru_bounded() -> None:
    default = CraftPlanner(PlannerConfig(policy="frequency", threshold=3))
    spaces = PlannerNamespaces(default, max_salted=2)
    assert spaces.get(None) is default
    a = spaces.get(CacheSalt("a"))
    assert isinstance(a, CraftPlanner) and a is not default
    assert a.config == default.config
    assert spaces.get(CacheSalt("a")) is a
    b = spaces.get(CacheSalt("b"))
    spaces.get(CacheSalt("a"))  # a is now the most recently used
    spaces.get(CacheSalt("c"))  # drops b, never the default
    assert spaces.salts() == ["a", "c"]
    assert spaces.peek(CacheSalt("b")) is None
    assert spaces.get(CacheSalt("b")) is not b  # a fresh planner for a dropped salt
    assert spaces.peek(None) is default
    spaces._check_invariants()
    with pytest.raises(ValueError, match="max_salt_namespaces"):
        PlannerNamespaces(default, max_salted=0)


def test_reset_drops_salted_planners_and_follows_the_new_config() -> None:
    spaces = PlannerNamespaces(CraftPlanner(PlannerConfig(policy="tree")))
    spaces.get(CacheSalt("a"))
    new = CraftPlanner(PlannerConfig(policy="retriever"))
    spaces.reset(new)
    assert spaces.salts() == [] and spaces.default is new
    salted = spaces.get(CacheSalt("a"))
    assert isinstance(salted, CraftPlanner) and salted.config.policy == "retriever"

    made: list[CraftPlanner] = []

    def factory() -> CraftPlanner:
        made.append(CraftPlanner(PlannerConfig(policy="frequency")))
        return made[-1]

    custom = PlannerNamespaces(new, factory)
    custom.reset(CraftPlanner())
    assert custom.get(CacheSalt("z")) is made[0]  # a custom factory survives a reset


def test_events_reach_every_planner_and_remove_only_matching_nodes() -> None:
    spaces = PlannerNamespaces(CraftPlanner(PlannerConfig(policy="tree")))
    chunks = make_chunks(2)
    planners = [spaces.get(None), spaces.get(CacheSalt("a")), spaces.get(CacheSalt("b"))]
    for i, planner in enumerate(planners):
        assert isinstance(planner, CraftPlanner)
        plan = planner.plan(chunks)
        # The same chunks in every namespace, but (as in vLLM) other block hashes per salt.
        hashes = [[BlockHash(bytes([i, j]))] for j in range(2)]
        planner.commit(plan, prefix_tokens=4, chunk_token_counts=[20, 20], block_hashes=hashes)
        assert len(planner.prefix_tree) == 2
    ram = KVLocation(tier="CPU")
    assert spaces.on_blocks_moved([BlockHash(bytes([2, 1]))], ram) == 1  # salt b's 2nd node
    assert [n.location for n in planners[2].prefix_tree.match(plan.keys).nodes] == [
        KVLocation(), ram]
    assert spaces.on_blocks_removed([BlockHash(bytes([1, 0]))]) == 2  # salt a's path only
    sizes = [len(p.prefix_tree) for p in planners if isinstance(p, CraftPlanner)]
    assert sizes == [2, 0, 2]
    spaces.on_all_blocks_cleared()
    assert all(len(p.prefix_tree) == 0 for p in planners if isinstance(p, CraftPlanner))


def test_end_conversation_reaches_only_the_namespace_of_its_salt() -> None:
    spaces = PlannerNamespaces(CraftPlanner(), max_salted=1)
    for salt in ("a", "b"):
        salted = spaces.get(CacheSalt(salt))
        salted.commit(salted.plan(make_chunks(1), "conv"))
    spaces.default.commit(spaces.default.plan(make_chunks(1), "conv"))
    assert not spaces.end_conversation("conv", "never-used")
    assert spaces.end_conversation("conv", "a")  # "a"'s planner was dropped: its kept store
    assert not spaces.end_conversation("conv", "a")
    assert spaces.get(CacheSalt("a")).committed_turns("conv") == 0
    assert spaces.get(CacheSalt("b")).committed_turns("conv") == 1  # "b" is kept now
    assert spaces.end_conversation("conv")  # the default tenant's only
    assert spaces.get(CacheSalt("b")).committed_turns("conv") == 1
    assert spaces.end_conversation("conv", "b")
    spaces._check_invariants()


def test_check_plan_accepts_a_pending_plan_of_this_planner() -> None:
    planner = CraftPlanner(PlannerConfig(policy="tree"))
    chunks = make_chunks(4)
    shuffled = chunks[:]
    random.Random(1).shuffle(shuffled)
    plan = planner.plan(shuffled, "c")
    assert check_plan(plan, planner, plan.ordered, "c") is plan
    assert check_plan(plan, planner, shuffled, None) is plan  # the chunks it was made from


def test_check_plan_refuses_what_cannot_be_served() -> None:
    planner = CraftPlanner(PlannerConfig(policy="tree"))
    chunks = make_chunks(3)
    plan = planner.plan(chunks, "c")
    with pytest.raises(ValueError, match=r"craft_rag\.planner\.Plan"):
        check_plan(object(), planner, chunks, None)
    with pytest.raises(ValueError, match="conversation 'c', not 'd'"):
        check_plan(plan, planner, chunks, "d")
    with pytest.raises(ValueError, match=r"missing \['doc-2'\]"):
        check_plan(plan, planner, chunks[:2], "c")
    with pytest.raises(ValueError, match="not in the plan"):
        check_plan(plan, planner, [*chunks, *make_chunks(1, prefix="x")], "c")
    other = CraftPlanner(PlannerConfig(policy="tree"))
    with pytest.raises(RuntimeError, match="made by another planner"):
        check_plan(plan, other, chunks, "c")
    planner.commit(plan)
    with pytest.raises(RuntimeError, match="already committed"):
        check_plan(plan, planner, chunks, "c")


def test_check_plan_refuses_a_stale_conversation_turn() -> None:
    planner = CraftPlanner(PlannerConfig(policy="tree"))
    early = planner.plan(make_chunks(2), "c")
    with pytest.raises(RuntimeError, match="has a plan in flight"):
        planner.plan(make_chunks(2), "c")  # the core refuses a second plan (issue 11 item 11)
    planner.end_conversation("c")  # ending it releases the conversation, not the plan
    served = planner.plan(make_chunks(2), "c")
    planner.commit(served)  # turn 1 is served by another plan
    with pytest.raises(RuntimeError, match="turn 1 of conversation 'c', which has 1 committed"):
        check_plan(early, planner, early.ordered, "c")


def test_check_plan_resolves_a_plan_ref_or_refuses_it_clearly() -> None:
    planner = CraftPlanner(PlannerConfig(policy="tree"))
    plan = planner.plan(make_chunks(2), "c")
    assert check_plan(plan.ref, planner, plan.ordered, None) is plan
    with pytest.raises(ValueError, match=r"^plan:"):
        check_plan("not-a-ref", planner, plan.ordered, None)
    with pytest.raises(RuntimeError, match="made by another planner"):
        check_plan(plan.ref, CraftPlanner(), plan.ordered, None)


def test_a_planner_and_an_engine_default_to_their_own_bounds() -> None:
    assert (DEFAULT_MAX_CONVERSATIONS, ENGINE_MAX_CONVERSATIONS) == (10_000, 1024)
    assert PlannerConfig().max_conversations == DEFAULT_MAX_CONVERSATIONS
    assert CraftPlanner().conversations.max_conversations == DEFAULT_MAX_CONVERSATIONS
    planner = default_planner()
    assert planner.config.max_conversations == ENGINE_MAX_CONVERSATIONS
    assert planner.conversations.max_conversations == ENGINE_MAX_CONVERSATIONS
    # The renderer module's former name stays importable, as the engine's bound (it warns:
    # one name per bound).
    with pytest.warns(DeprecationWarning, match="ENGINE_MAX_CONVERSATIONS"):
        assert conversation_prompts.DEFAULT_MAX_CONVERSATIONS == ENGINE_MAX_CONVERSATIONS


def test_an_engine_without_a_planner_keeps_the_engine_bound() -> None:
    backend = FakeBackend()
    engine = CraftEngine(
        backend=backend,
        tokenizer=HashingTokenizer(),
        prompt_format=FAKE_FORMAT,
        block_hasher=backend.block_hasher,
    )
    try:
        assert engine.planner.config.max_conversations == ENGINE_MAX_CONVERSATIONS
        assert engine.planner.conversations.max_conversations == ENGINE_MAX_CONVERSATIONS
    finally:
        engine.close()


def test_bound_conversations_sets_config_and_store() -> None:
    planner = bound_conversations(CraftPlanner(), 7)
    assert planner.config.max_conversations == 7
    assert planner.conversations.max_conversations == 7
