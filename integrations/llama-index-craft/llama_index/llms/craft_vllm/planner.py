"""The engine-side planner adapter that lets the engine serve a postprocessor's plan as is.

``CraftEngine`` plans every request itself (``planner.plan`` in, ``planner.commit`` with what
vLLM reused out). In a LlamaIndex pipeline the plan was already made by a
:class:`~llama_index.postprocessor.craft.CraftReorderPostprocessor` in ``commit_mode="engine"``,
which parked it in a :class:`~llama_index.postprocessor.craft.PlanHandoff`. This adapter is
installed as the engine's planner: for a request whose chunks (in order) and conversation match
a parked plan it returns that plan, so the engine renders exactly the order the pipeline saw and
commits it with the engine's truth; any other request is planned by the wrapped planner.

Once ``CraftEngine`` can serve a given plan directly (a ``plan=`` argument), this adapter can go.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from llama_index.postprocessor.craft.events import CraftCommitEvent
from llama_index.postprocessor.craft.handoff import PlanHandoff
from llama_index_instrumentation import get_dispatcher

from craft_rag import CommitResult, CraftPlanner, KVLocation, Plan
from craft_rag.chunk import Chunk
from craft_rag.types import BlockHash

dispatcher = get_dispatcher(__name__)


class HandoffPlanner:
    """A ``craft_rag.engine.engine.PlannerLike`` over a :class:`craft_rag.CraftPlanner`.

    Invariant: state lives only in the wrapped planner (``planner``); the adapter owns just the
    handoff of parked plans. Every commit emits a ``CraftCommitEvent(source="engine")`` whose
    ``reuse`` holds the engine's commit arguments (prefix tokens, chunk token counts, reused
    chunks). Cost: O(k) per plan on top of the planner's own.
    """

    def __init__(self, planner: CraftPlanner, handoff: PlanHandoff | None = None) -> None:
        if not isinstance(planner, CraftPlanner):
            msg = f"planner must be a craft_rag.CraftPlanner, got {type(planner).__name__}"
            raise ValueError(msg)
        self.planner = planner
        self.handoff = handoff if handoff is not None else PlanHandoff()

    @property
    def config(self) -> Any:
        return self.planner.config

    @property
    def stats(self) -> Any:
        return self.planner.stats

    def plan(self, chunks: Sequence[Chunk], conversation_id: str | None = None) -> Plan:
        parked = self.handoff.claim(conversation_id, [c.key for c in chunks])
        if parked is not None:
            return parked
        return self.planner.plan(chunks, conversation_id)

    def commit(
        self,
        plan: Plan,
        *,
        prefix_tokens: int | None = None,
        chunk_token_counts: Sequence[int] | None = None,
        reused_chunks: int | None = None,
        block_hashes: Sequence[Sequence[BlockHash]] | None = None,
        location: KVLocation | None = None,
    ) -> CommitResult:
        result = self.planner.commit(
            plan,
            prefix_tokens=prefix_tokens,
            chunk_token_counts=chunk_token_counts,
            reused_chunks=reused_chunks,
            block_hashes=block_hashes,
            location=location,
        )
        reuse = {
            "prefix_tokens": prefix_tokens,
            "chunk_token_counts": list(chunk_token_counts or ()),
            "reused_chunks": reused_chunks,
        }
        dispatcher.event(CraftCommitEvent(plan=plan, result=result, source="engine", reuse=reuse))
        return result

    def on_blocks_removed(self, hashes: Iterable[BlockHash]) -> int:
        return self.planner.on_blocks_removed(hashes)

    def on_blocks_moved(self, hashes: Iterable[BlockHash], location: KVLocation) -> int:
        return self.planner.on_blocks_moved(hashes, location)

    def on_all_blocks_cleared(self) -> None:
        self.planner.on_all_blocks_cleared()

    def end_conversation(self, conversation_id: str) -> bool:
        return self.planner.end_conversation(conversation_id)
