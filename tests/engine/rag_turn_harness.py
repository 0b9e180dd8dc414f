"""The planner path of a conversation turn without an engine: :class:`TurnHarness` wires a
:class:`~craft_rag.engine.planners.PlannerNamespaces`, a
:class:`~craft_rag.engine.conversation_prompts.ConversationPrompts` and the engine's own
:class:`~craft_rag.engine.rag_turn.RagTurns`; the test gives each served turn's reply.
(Imported by the renderer's tests in this folder; pytest puts the folder on ``sys.path``.)"""

from __future__ import annotations

from collections.abc import Sequence

from craft_rag.chunk import Chunk
from craft_rag.engine.conversation_prompts import ConversationPrompts, RenderedTurn
from craft_rag.engine.driver import RequestState
from craft_rag.engine.history_budget import HistoryBudget
from craft_rag.engine.planners import PlannerNamespaces
from craft_rag.engine.rag_turn import RagTurn, RagTurns
from craft_rag.engine.requests import InFlight
from craft_rag.engine.results import RagRequest, SamplingRequest
from craft_rag.engine.turn_layout import APPEND_ONLY, TurnLayoutPolicy
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.prompt import PromptAssembler, PromptFormat
from craft_rag.testing import FAKE_FORMAT
from craft_rag.tokenizer import HashingTokenizer
from craft_rag.types import CacheSalt
from craft_rag.validation import validate_cache_salt


class TurnHarness:
    """Turns of conversations served through the planner (plan -> render -> commit), with
    ``reply`` ids as the model's output. ``block_size``/``eos_token_ids``: the cache facts;
    ``chat_format``: conversation turns' format (default: the single-turn one)."""

    def __init__(
        self,
        *,
        max_model_len: int = 400,
        max_conversations: int = 8,
        history_budget: HistoryBudget | None = None,
        turn_layout: TurnLayoutPolicy = APPEND_ONLY,
        block_size: int = 16,
        eos_token_ids: frozenset[int] = frozenset(),
        chat_format: PromptFormat | None = None,
    ) -> None:
        tokenizer = HashingTokenizer()
        config = PlannerConfig(policy="tree", max_conversations=max_conversations)
        self.namespaces = PlannerNamespaces(CraftPlanner(config))
        self.prompts = ConversationPrompts(
            PromptAssembler(tokenizer, FAKE_FORMAT),
            max_model_len=max_model_len,
            stores=self.namespaces,
            history_budget=history_budget,
            turn_layout=turn_layout,
            chat_assembler=None if chat_format is None else PromptAssembler(tokenizer, chat_format),
        )
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.turns = RagTurns(
            self.namespaces, self.prompts, self._submit, self, check_salt=validate_cache_salt
        )

    def _submit(
        self,
        token_ids: tuple[int, ...],
        sampling: SamplingRequest,
        state: RequestState,
        *,
        cache_salt: CacheSalt | None,
    ) -> None:
        del token_ids, sampling, cache_salt
        state.num_cached_tokens = 0
        state.finish_reason = "stop"
        state.done.set()

    def start(
        self,
        chunks: Sequence[Chunk],
        question: str,
        *,
        conversation_id: str | None = None,
        cache_salt: str | None = None,
        max_tokens: int = 8,
    ) -> InFlight:
        """Plan, render and "serve" one turn; ``rendered(flight)`` is its prompt."""
        sampling = SamplingRequest(max_tokens=max_tokens)
        request = RagRequest(
            chunks, question, conversation_id, cache_salt=cache_salt, sampling=sampling
        )
        return self.turns.start(request, sampling)

    def finish(self, flight: InFlight, reply: Sequence[int]) -> RenderedTurn:
        """Commit the turn with ``reply`` as the generated ids."""
        turn = rag_turn(flight)
        flight.state.token_ids = list(reply)
        self.turns.commit(flight, turn)
        return turn.rendered

    def serve(
        self,
        chunks: Sequence[Chunk],
        question: str,
        reply: Sequence[int],
        **where: str | int | None,
    ) -> RenderedTurn:
        """``start`` then ``finish``: one whole turn."""
        return self.finish(self.start(chunks, question, **where), reply)  # type: ignore[arg-type]


def rag_turn(flight: InFlight) -> RagTurn:
    turn = flight.turn
    assert isinstance(turn, RagTurn)
    return turn


def rendered(flight: InFlight) -> RenderedTurn:
    """The prompt a started turn was rendered to."""
    return rag_turn(flight).rendered
