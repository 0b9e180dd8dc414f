"""A real ``CraftEngine`` over a fake backend: the engine's planning, rendering, committing and
streaming code runs as in production, only the forward pass is simulated (no vLLM, no model).

The backend caches prompts at block granularity (cached = the longest prefix of full blocks
seen before, capped so the last prompt token is recomputed; a ``cache_salt`` is mixed into the
first block's hash, and so into every chained one, as vLLM does) and replies ``t101 t102 ...``,
one token per step. Plain chats are rendered with a ChatML template. (Named uniquely, not
``conftest``/``fakes``: the repository runs every test folder in one pytest session.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from craft_rag import CraftPlanner, PlannerConfig
from craft_rag.engine.chat_format import jinja_renderer
from craft_rag.engine.engine import CraftEngine
from craft_rag.engine.results import SamplingRequest, StepOutput
from craft_rag.prompt import PromptFormat
from craft_rag.tokenizer import HashingTokenizer

FAKE_BLOCK = 16
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FAKE_FORMAT = PromptFormat(
    head="<s>SYS. Answer from the documents.\n",
    chunk="Doc: {text}\n",
    question="Q: {question}",
    tail=" </u><a>",
    answer="{answer} </a><u>",
)


def _block_hashes(
    token_ids: Sequence[int], block: int, cache_salt: str | None = None
) -> list[bytes]:
    out: list[bytes] = []
    # Like vLLM: the salt goes into the first block's hash; every later hash chains on it.
    parent = b"" if cache_salt is None else b"salt:" + cache_salt.encode()
    for start in range(0, len(token_ids) - block + 1, block):
        digest = hashlib.sha256(parent + repr(tuple(token_ids[start : start + block])).encode())
        parent = digest.digest()
        out.append(parent)
    return out


@dataclass
class _Running:
    token_ids: list[int]
    sampling: SamplingRequest
    cached: int
    produced: int = 0


@dataclass
class FakeBackend:
    max_model_len: int = 1024
    block_size: int = FAKE_BLOCK
    prefix_caching: bool = True
    eos_token_ids: frozenset[int] = frozenset({2})
    reply: Sequence[int] = (101, 102, 103, 104, 105, 106, 107, 108)
    cached_blocks: set[bytes] = field(default_factory=set)
    running: dict[str, _Running] = field(default_factory=dict)
    added: list[tuple[str, tuple[int, ...], SamplingRequest]] = field(default_factory=list)
    salts: list[str | None] = field(default_factory=list)

    def add_request(
        self,
        request_id: str,
        token_ids: Sequence[int],
        sampling: SamplingRequest,
        cache_salt: str | None = None,
    ) -> None:
        if len(token_ids) + sampling.max_tokens > self.max_model_len:
            raise ValueError("prompt too long for the fake engine")
        hashes = _block_hashes(token_ids, self.block_size, cache_salt)
        cached = 0
        if sampling.read_prefix_cache:
            for h in hashes:
                if h not in self.cached_blocks:
                    break
                cached += self.block_size
            cached = min(cached, (len(token_ids) - 1) // self.block_size * self.block_size)
        self.cached_blocks.update(hashes)
        self.salts.append(cache_salt)
        self.running[request_id] = _Running(list(token_ids), sampling, cached)
        self.added.append((request_id, tuple(token_ids), sampling))

    def step(self) -> list[StepOutput]:
        outs: list[StepOutput] = []
        for rid, req in list(self.running.items()):
            token = self.reply[req.produced % len(self.reply)]
            req.produced += 1
            done = req.produced >= req.sampling.max_tokens
            if done:
                del self.running[rid]
            outs.append(
                StepOutput(
                    request_id=rid,
                    new_token_ids=(token,),
                    new_text=f"t{token} ",
                    finished=done,
                    finish_reason="length" if done else None,
                    num_cached_tokens=req.cached,
                )
            )
        return outs

    def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.running.pop(rid, None)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def reset_prefix_cache(self) -> bool:
        self.cached_blocks.clear()
        return True

    def published_batches(self) -> int | None:
        return None

    def shutdown(self) -> None:
        pass


def make_fake_engine(
    engine_kwargs: dict[str, Any] | None = None, **backend_kwargs: Any
) -> tuple[CraftEngine, FakeBackend]:
    backend = FakeBackend(**backend_kwargs)
    engine = CraftEngine(
        planner=CraftPlanner(PlannerConfig(policy="tree")),
        backend=backend,
        tokenizer=HashingTokenizer(),
        prompt_format=FAKE_FORMAT,
        chat_renderer=jinja_renderer(CHATML),
        **(engine_kwargs or {}),
    )
    return engine, backend
