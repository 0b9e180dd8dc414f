"""Conversations are scoped by tenant (the vLLM ``cache_salt``): the same conversation id under
two salts is two independent conversations. Ending or continuing one never touches another
tenant's, and nothing a tenant sees (results, errors, reprs) tells whether another tenant uses
an id. Fake backend with the real planners and renderer for the logic (shared stores:
tests/stores/test_tenant_scoping.py); one ``engine`` test on the real in-process vLLM engine."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from craft_rag.engine.engine import CraftEngine
from craft_rag.engine.results import RagRequest
from craft_rag.testing import FakeBackend, make_chunks

Factory = Callable[..., tuple[CraftEngine, FakeBackend]]

SECRET_A = "tenant-a-secret-9f1c"
SECRET_B = "tenant-b-secret-77d0"
CONV = "support-1"


def test_one_id_under_two_salts_is_two_conversations(make_fake_engine: Factory) -> None:
    engine, _ = make_fake_engine()
    a1 = engine.generate(make_chunks(2), "Q1?", conversation_id=CONV, cache_salt=SECRET_A)
    # Tenant B uses the same id: its own first turn, no error, nothing of A's in its prompt.
    b1 = engine.generate(make_chunks(2), "Q1?", conversation_id=CONV, cache_salt=SECRET_B)
    assert (a1.report.turn, b1.report.turn) == (1, 1)
    assert b1.report.removed_duplicates == ()
    u1 = engine.generate(make_chunks(1), "Q1?", conversation_id=CONV)
    assert u1.report.turn == 1
    a2 = engine.generate(
        make_chunks(3), "Q2?", conversation_id=CONV, max_tokens=2, cache_salt=SECRET_A
    )
    assert a2.report.turn == 2 and a2.report.removed_duplicates == (
        make_chunks(3)[0].key, make_chunks(3)[1].key,
    )
    assert a2.prompt_token_ids[: len(a1.prompt_token_ids)] == a1.prompt_token_ids
    assert engine.turn_count(CONV, cache_salt=SECRET_A) == 2
    assert engine.turn_count(CONV, cache_salt=SECRET_B) == 1
    assert engine.turn_count(CONV) == 1


def test_ending_one_tenants_conversation_leaves_the_others(make_fake_engine: Factory) -> None:
    engine, _ = make_fake_engine()
    for salt in (SECRET_A, SECRET_B, None):
        engine.generate(make_chunks(2), "Q1?", conversation_id=CONV, cache_salt=salt)
    assert engine.end_conversation(CONV, cache_salt=SECRET_B)
    assert not engine.end_conversation(CONV, cache_salt=SECRET_B)  # already ended
    assert engine.turn_count(CONV, cache_salt=SECRET_B) == 0
    assert engine.turn_count(CONV, cache_salt=SECRET_A) == 1
    # The old call (no salt) ends the unsalted conversation only.
    assert engine.end_conversation(CONV)
    assert engine.turn_count(CONV) == 0
    assert engine.turn_count(CONV, cache_salt=SECRET_A) == 1
    a2 = engine.generate(make_chunks(2), "Q2?", conversation_id=CONV, cache_salt=SECRET_A)
    assert a2.report.turn == 2 and len(a2.report.removed_duplicates) == 2
    # Ending under a salt that never had the conversation (or another worker's unknown salt).
    assert not engine.end_conversation(CONV, cache_salt="never-used")
    with pytest.raises(ValueError, match="cache_salt"):
        engine.end_conversation(CONV, cache_salt="a/b")


def test_another_tenants_turn_in_flight_is_invisible(make_fake_engine: Factory) -> None:
    """A's turn is planned and not served (its plan holds A's conversation): B's turn on the
    same id is served, and B's errors never name A's salt or say the id is in use."""
    engine, _ = make_fake_engine()
    engine.generate(make_chunks(1), "Q1?", conversation_id=CONV, cache_salt=SECRET_A)
    held = engine.planner_for(SECRET_A).plan(make_chunks(2), CONV)
    b1 = engine.generate(make_chunks(2), "Q1?", conversation_id=CONV, cache_salt=SECRET_B)
    assert b1.report.turn == 1
    # B may not serve A's plan: refused without naming A's salt.
    with pytest.raises(RuntimeError) as refused:
        engine.generate(make_chunks(2), "Q?", plan=held, cache_salt=SECRET_B)
    assert SECRET_A not in str(refused.value)
    a2 = engine.generate(make_chunks(2), "Q2?", plan=held, cache_salt=SECRET_A)
    assert a2.report.turn == 2


def test_salts_stay_out_of_reprs(make_fake_engine: Factory) -> None:
    engine, _ = make_fake_engine()
    request = RagRequest(make_chunks(1), "Q?", cache_salt=SECRET_A, conversation_id=CONV)
    handle = engine.submit(request)
    result = handle.result()
    for text in (repr(request), str(request), repr(result), repr(result.report), repr(handle)):
        assert SECRET_A not in text


def test_integration_models_keep_salts_out_of_their_reprs() -> None:
    """The LLM classes and the LangChain conversation take a default cache_salt: their reprs
    (what tracebacks, debuggers and log lines show) never include it."""
    from craft_rag.testing import make_fake_engine as make

    engine, _ = make()
    try:
        shown: list[str] = []
        try:
            from langchain_craft import ChatCraftVLLM, CraftConversation
        except ImportError:
            pass
        else:
            chat = ChatCraftVLLM(engine=engine, cache_salt=SECRET_A)
            conv = CraftConversation(llm=chat, cache_salt=SECRET_B)
            shown += [repr(chat), str(chat), repr(conv), str(conv)]
        try:
            from llama_index.llms.craft_vllm import CraftVLLM
        except ImportError:
            pass
        else:
            llm = CraftVLLM(engine, cache_salt=SECRET_A)
            shown += [repr(llm), str(llm)]
        assert shown and all(SECRET_A not in s and SECRET_B not in s for s in shown)
    finally:
        engine.close()


@pytest.mark.engine
def test_real_engine_tenants_share_an_id_without_sharing_the_conversation(
    craft_engine: CraftEngine,
) -> None:
    conv = "tenant-scope-real"
    chunks = make_chunks(3, words=40)
    try:
        a1 = craft_engine.generate(
            chunks[:2], "What is w0?", conversation_id=conv, cache_salt=SECRET_A, max_tokens=4
        )
        b1 = craft_engine.generate(
            chunks[:2], "What is w0?", conversation_id=conv, cache_salt=SECRET_B, max_tokens=4
        )
        assert (a1.report.turn, b1.report.turn) == (1, 1)
        assert b1.report.cached_tokens == 0  # another salt: nothing of A's cache
        assert craft_engine.end_conversation(conv, cache_salt=SECRET_B)
        a2 = craft_engine.generate(
            chunks[1:], "And w2?", conversation_id=conv, cache_salt=SECRET_A, max_tokens=4
        )
        assert a2.report.turn == 2 and a2.report.removed_duplicates == (chunks[1].key,)
        assert a2.report.cached_tokens >= len(a1.prompt_token_ids) - 32
        assert a2.prompt_token_ids[: len(a1.prompt_token_ids)] == a1.prompt_token_ids
    finally:
        for salt in (SECRET_A, SECRET_B):
            craft_engine.end_conversation(conv, cache_salt=salt)


@pytest.mark.parametrize("bad", [f"{SECRET_A}/x", f"{SECRET_A}@x", SECRET_A * 10])
def test_a_refused_salt_is_not_quoted_by_the_integrations(bad: str) -> None:
    """The LLM classes refuse a bad default salt; pydantic's error must not quote it."""
    from craft_rag.testing import make_fake_engine as make

    engine, _ = make()
    try:
        errors: list[BaseException] = []
        try:
            from llama_index.llms.craft_vllm import CraftVLLM
        except ImportError:
            pass
        else:
            with pytest.raises(ValueError) as refused:
                CraftVLLM(engine, cache_salt=bad)
            errors.append(refused.value)
        try:
            from langchain_craft import ChatCraftVLLM
        except ImportError:
            pass
        else:
            chat = ChatCraftVLLM(engine=engine, cache_salt=bad)
            with pytest.raises(ValueError) as refused:
                chat.invoke("hi")
            errors.append(refused.value)
        assert errors and all(SECRET_A not in str(e) for e in errors)
    finally:
        engine.close()
