"""A fake engine backend for fast tests of the engine logic (no vLLM, no model).

``FakeBackend`` simulates vLLM's prefix cache at block granularity with the real
:class:`BlockHasher` (cached = longest prefix of full blocks already stored, capped so the last
prompt token is recomputed), emits one token per step, and can be told to fail.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.engine.kv_events import BlockHasher
from craft_rag.engine.results import SamplingRequest, StepOutput
from craft_rag.prompt import PromptFormat

FAKE_BLOCK = 16


@dataclass
class _FakeRequest:
    request_id: str
    token_ids: list[int]
    sampling: SamplingRequest
    cached: int
    produced: int = 0


@dataclass
class FakeBackend:
    max_model_len: int = 512
    block_size: int = FAKE_BLOCK
    prefix_caching: bool = True
    eos_token_ids: frozenset[int] = frozenset({2})
    reply: Sequence[int] = (101, 102, 103, 104, 105, 106, 107, 108)
    fail_on_step: bool = False
    step_gate: threading.Event | None = None
    step_delay: float = 0.0
    hasher: BlockHasher = field(default_factory=lambda: BlockHasher.for_algo(FAKE_BLOCK))
    cached_blocks: set[bytes] = field(default_factory=set)
    running: dict[str, _FakeRequest] = field(default_factory=dict)
    added: list[tuple[str, tuple[int, ...], SamplingRequest]] = field(default_factory=list)
    salts: list[str | None] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    shut_down: bool = False

    def add_request(
        self,
        request_id: str,
        token_ids: Sequence[int],
        sampling: SamplingRequest,
        cache_salt: str | None = None,
    ) -> None:
        if len(token_ids) + sampling.max_tokens > self.max_model_len:
            raise ValueError("prompt too long for the fake engine")
        # As vLLM: the salt is mixed into the first block's hash, so it changes every block's.
        hashes = self.hasher.raw_hashes(token_ids, cache_salt)
        cached = 0
        if sampling.read_prefix_cache:
            for h in hashes:
                if h not in self.cached_blocks:
                    break
                cached += self.block_size
            cached = min(cached, (len(token_ids) - 1) // self.block_size * self.block_size)
        self.cached_blocks.update(hashes)
        self.salts.append(cache_salt)
        self.running[request_id] = _FakeRequest(request_id, list(token_ids), sampling, cached)
        self.added.append((request_id, tuple(token_ids), sampling))

    def step(self) -> list[StepOutput]:
        if self.step_gate is not None:
            self.step_gate.wait(5)
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail_on_step:
            raise RuntimeError("simulated engine crash")
        outs: list[StepOutput] = []
        for req in list(self.running.values()):
            token = self.reply[req.produced % len(self.reply)]
            req.produced += 1
            done = req.produced >= req.sampling.max_tokens
            if done:
                del self.running[req.request_id]
            outs.append(
                StepOutput(
                    request_id=req.request_id,
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
            self.aborted.append(rid)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def reset_prefix_cache(self) -> bool:
        self.cached_blocks.clear()
        return True

    def published_batches(self) -> int | None:
        return None

    def shutdown(self) -> None:
        self.shut_down = True


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


def make_chunks(n: int, *, words: int = 20, prefix: str = "doc", seed: int = 0) -> list[Chunk]:
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(200)]
    return [
        make_chunk(" ".join(rng.choice(vocab) for _ in range(words)), id=f"{prefix}-{i}")
        for i in range(n)
    ]


