"""Cache-aware admission with ``CraftEngine(server=[url, url])`` (issue 30): every replica's
engine gets the settings, so each routed request's completion body carries ``priority``, the
admission key of the routed plan's predicted cached tokens on that replica (two in-process
fakes of vLLM's HTTP API; the real priority scheduler is tested in tests/engine)."""

from __future__ import annotations

import json
from pathlib import Path

from fake_server import FakeServer, running

from craft_rag.chunk import make_chunk
from craft_rag.engine.backends.server.backend import ServerSettings
from craft_rag.engine.chat_format import jinja_renderer
from craft_rag.engine.engine import CraftEngine, EngineSettings
from craft_rag.prompt import PromptFormat
from craft_rag.scheduling import PRIORITY_SCALE, AdmissionOrder
from craft_rag.tokenizer import HashingTokenizer

FORMAT = PromptFormat(head="<s>SYS.\n", chunk="Doc: {text}\n", question="Q: {question}",
                      tail=" </u><a>", answer="{answer} </a><u>")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_routed_requests_send_their_admission_key_as_priority(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    docs = [make_chunk(f"doc {i} " + " ".join(f"w{i}x{j}" for j in range(10)), id=f"d{i}")
            for i in range(4)]
    fakes = [FakeServer(), FakeServer()]
    with running(fakes[0]) as url0, running(fakes[1]) as url1:
        engine = CraftEngine(
            EngineSettings(model=tmp_path, admission="cache_aware", admission_window=8),
            tokenizer=HashingTokenizer(), prompt_format=FORMAT,
            chat_renderer=jinja_renderer(CHATML),
            server=[ServerSettings(u, kv_events=False, backoff=0.01, retries=0)
                    for u in (url0, url1)],
        )
        try:
            first = engine.generate(docs, "what?", max_tokens=2)
            again = engine.generate(list(reversed(docs)), "and?", max_tokens=2)
        finally:
            engine.close()
    assert again.report.replica == first.report.replica  # routed back to the holder
    home = fakes[(url0, url1).index(first.report.replica)]
    sent = [b for b in home.bodies if "priority" in b]
    assert len(sent) == 2  # both requests, each with its key
    order = AdmissionOrder("cache_aware", 8)
    assert sent[0]["priority"] == order.key_of(0, 0.0)  # cold: nothing predicted
    predicted = again.report.predicted_tokens
    assert predicted is not None and predicted > 0
    prompt = again.report.prompt_tokens
    assert sent[1]["priority"] == order.key_of(1, order.fraction(min(predicted, prompt), prompt))
    assert sent[1]["priority"] < order.key_of(1, 0.0) == 9 * PRIORITY_SCALE  # ahead of cold
