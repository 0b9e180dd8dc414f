"""Hypothesis state machine over TieredBlockStore: every step keeps the invariants, and a get
returns either nothing or exactly the payload that was put under that key."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from craft_rag.kvtiers import disk_tier
from craft_rag.kvtiers.keys import BlockKey, chain_keys
from craft_rag.kvtiers.store import TieredBlockStore

BLOCK = 2
SIZE = 64
# four prompts over a shared trunk: entries get several children per tier
PROMPTS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9], [1, 2, 7, 7, 8, 8], [5, 5, 6, 6, 7, 7]]


def payload_of(key: BlockKey) -> bytes:
    return key[:1] * SIZE


class StoreMachine(RuleBasedStateMachine):
    write_through = False  # subclasses turn it on

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="kvtiers-machine-"))
        self.folder = self.root / "tiers"
        self.store = TieredBlockStore(
            3 * SIZE, 4 * SIZE, self.folder, policy="pgdsf", write_through=self.write_through
        )
        self.blocks: list[tuple[BlockKey, BlockKey | None, list[int], int]] = []
        for tokens in PROMPTS:
            for salt in (None, "t"):
                keys = chain_keys(tokens, BLOCK, salt)
                for i, key in enumerate(keys):
                    parent = keys[i - 1] if i else None
                    self.blocks.append(
                        (key, parent, tokens[i * BLOCK : (i + 1) * BLOCK], i * BLOCK)
                    )
        self.pinned: list[BlockKey] = []

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)

    @rule(index=st.integers(0, 23))
    def put(self, index: int) -> None:
        key, parent, tokens, prefix = self.blocks[index]
        self.store.put(key, parent, tokens, payload_of(key), prefix)

    @rule(index=st.integers(0, 23), wrong=st.booleans())
    def get(self, index: int, wrong: bool) -> None:
        key, _, tokens, _ = self.blocks[index]
        got = self.store.get(key, [t + 1 for t in tokens] if wrong else tokens)
        assert got is None if wrong else got in (None, payload_of(key))

    @rule(index=st.integers(0, 23))
    def pin(self, index: int) -> None:
        key = self.blocks[index][0]
        if self.store.lookup_and_pin([key]):
            self.pinned.append(key)

    @precondition(lambda self: bool(self.pinned))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = self.pinned.pop(data.draw(st.integers(0, len(self.pinned) - 1)))
        self.store.unpin([key])

    @rule(index=st.integers(0, 23))
    def corrupt(self, index: int) -> None:
        self.store.flush()
        path = disk_tier.block_path(self.folder.resolve(), self.blocks[index][0])
        if path.exists():
            data = bytearray(path.read_bytes())
            data[-1] ^= 0x55
            path.write_bytes(bytes(data))

    @rule()
    def restart(self) -> None:
        for key in self.pinned:
            self.store.unpin([key])
        self.pinned.clear()
        self.store.close()
        self.store = TieredBlockStore(
            3 * SIZE, 4 * SIZE, self.folder, policy="pgdsf", write_through=self.write_through
        )

    @invariant()
    def holds(self) -> None:
        self.store._check_invariants()


StoreMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreMachine = StoreMachine.TestCase
