"""What a :class:`~craft_rag.engine.CraftEngine` is built from, grouped by what each part decides.

``CraftEngine(settings, planner, *, server=..., planners=..., rendering=..., conversation=...,
parts=...)``: besides the backend's :class:`~craft_rag.engine.EngineSettings` and the default
planner, four frozen groups, each owned by one piece of the engine:

- :class:`PlannerSettings`: how the planners are made and bounded (one per cache salt, the
  conversation bound, the shared store) -> :class:`~craft_rag.engine.planners.PlannerNamespaces`;
- :class:`RenderingSettings`: the prompt text around the documents (formats, system prompt,
  instructions) -> the assemblers;
- :class:`ConversationSettings`: how a conversation's prompt grows (history budget, append or
  restart) -> :class:`~craft_rag.engine.conversation_prompts.ConversationPrompts`;
- :class:`BackendParts`: replacements for the vLLM and model pieces (tests use fakes) -> wiring.

The flat keywords (``CraftEngine(store=..., turn_layout=..., backend=...)``) keep working: each
is a field of one group (:data:`FLAT_KEYWORDS`) and :func:`group_keywords` folds them in. A
keyword and the group it belongs to cannot both be given (``ValueError``), so there is one
place a value comes from. Values are checked where they are used, as before (a bad
``prompt_format`` still raises ``ValueError`` naming the field).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict, TypeVar

from craft_rag.engine.conversation_prompts import DEFAULT_HISTORY_BUDGET, HistoryBudget
from craft_rag.engine.planners import DEFAULT_MAX_SALT_NAMESPACES
from craft_rag.engine.turn_layout import DEFAULT_TURN_LAYOUT, TurnLayoutPolicy
from craft_rag.prompt import DEFAULT_INSTRUCTIONS, PromptFormat

if TYPE_CHECKING:
    from craft_rag.engine.chat_format import RenderFn
    from craft_rag.engine.kv_events import BlockHasher
    from craft_rag.engine.wiring import ManagedBackend
    from craft_rag.planner import CraftPlanner
    from craft_rag.stores.base import StateStore
    from craft_rag.tokenizer import Tokenizer

__all__ = [
    "FLAT_KEYWORDS",
    "BackendParts",
    "ConversationSettings",
    "EngineParts",
    "FlatKeywords",
    "PlannerSettings",
    "RenderingSettings",
    "group_keywords",
]

_G = TypeVar("_G")


@dataclass(frozen=True, slots=True)
class PlannerSettings:
    """How the engine's planners are made and bounded.

    ``max_conversations``: the conversations each planner keeps (one LRU + TTL bound on its
    conversation store); ``None`` keeps a given planner's own bound and gives the default
    planner :data:`~craft_rag.engine.conversation_prompts.ENGINE_MAX_CONVERSATIONS` (with
    ``store``: ``PlannerConfig``'s default, shared with the store's other workers).
    ``salt_planner_factory`` makes each cache salt's planner (default: a ``CraftPlanner`` with
    the default planner's config), at most ``max_salt_namespaces`` of them (least recently used
    dropped). ``store``: planner state shared with other workers (``memory://``,
    ``sqlite:///path``, ``redis://...`` or a :class:`~craft_rag.stores.base.StateStore`); not
    combined with a given planner or ``salt_planner_factory``.
    """

    max_conversations: int | None = None
    salt_planner_factory: Callable[[], CraftPlanner] | None = None
    max_salt_namespaces: int = DEFAULT_MAX_SALT_NAMESPACES
    store: StateStore | str | None = None


@dataclass(frozen=True, slots=True)
class RenderingSettings:
    """The prompt text around the documents.

    ``prompt_format`` renders requests without a conversation (default: derived from the
    model's chat template); ``chat_prompt_format`` renders conversation turns (default:
    ``prompt_format`` when given, else derived with the question as its own user message where
    the template allows it). ``system_prompt`` is fixed at the head of every prompt;
    ``instructions`` come before each request's first document.
    """

    prompt_format: PromptFormat | None = None
    chat_prompt_format: PromptFormat | None = None
    system_prompt: str | None = None
    instructions: str = DEFAULT_INSTRUCTIONS


@dataclass(frozen=True, slots=True)
class ConversationSettings:
    """How a conversation's prompt grows: ``history_budget`` bounds its stored history (oldest
    whole turns dropped; ``None``: only ``max_model_len``), ``turn_layout`` decides per turn
    between appending and restarting with a compacted history (``APPEND_ONLY`` turns it off)."""

    history_budget: HistoryBudget | None = DEFAULT_HISTORY_BUDGET
    turn_layout: TurnLayoutPolicy = DEFAULT_TURN_LAYOUT


@dataclass(frozen=True, slots=True)
class BackendParts:
    """Replacements for the vLLM and model pieces; all ``None`` (the default) resolves the
    model, starts vLLM (or connects to ``server``) and subscribes to its KV events. Tests give
    a fake ``backend`` with a ``tokenizer``, ``block_hasher`` and ``chat_renderer``."""

    backend: ManagedBackend | None = None
    tokenizer: Tokenizer | None = None
    block_hasher: BlockHasher | None = None
    chat_renderer: RenderFn | None = None


class FlatKeywords(TypedDict, total=False):
    """``CraftEngine``'s keywords from before the groups; each is one group's field."""

    prompt_format: PromptFormat | None
    chat_prompt_format: PromptFormat | None
    system_prompt: str | None
    instructions: str
    max_conversations: int | None
    salt_planner_factory: Callable[[], CraftPlanner] | None
    max_salt_namespaces: int
    store: StateStore | str | None
    history_budget: HistoryBudget | None
    turn_layout: TurnLayoutPolicy
    backend: ManagedBackend | None
    tokenizer: Tokenizer | None
    block_hasher: BlockHasher | None
    chat_renderer: RenderFn | None


#: Each flat keyword -> the :class:`EngineParts` field (group) it belongs to.
FLAT_KEYWORDS: Mapping[str, str] = {
    **dict.fromkeys(("max_conversations", "salt_planner_factory"), "planners"),
    **dict.fromkeys(("max_salt_namespaces", "store"), "planners"),
    **dict.fromkeys(("prompt_format", "chat_prompt_format"), "rendering"),
    **dict.fromkeys(("system_prompt", "instructions"), "rendering"),
    **dict.fromkeys(("history_budget", "turn_layout"), "conversation"),
    **dict.fromkeys(("backend", "tokenizer", "block_hasher", "chat_renderer"), "parts"),
}


@dataclass(frozen=True, slots=True)
class EngineParts:
    """The four groups, resolved (none missing)."""

    planners: PlannerSettings
    rendering: RenderingSettings
    conversation: ConversationSettings
    parts: BackendParts


def group_keywords(
    planners: PlannerSettings | None,
    rendering: RenderingSettings | None,
    conversation: ConversationSettings | None,
    parts: BackendParts | None,
    flat: Mapping[str, object],
) -> EngineParts:
    """The groups with ``flat`` keywords folded in (defaults for groups not given). O(keywords).

    ``TypeError`` for an unknown keyword (as Python's own, listing the valid ones);
    ``ValueError`` when a keyword's group was given too (pass the value in one place)."""
    given: dict[str, object] = {
        "planners": planners,
        "rendering": rendering,
        "conversation": conversation,
        "parts": parts,
    }
    for group, value in given.items():
        if value is not None and not isinstance(value, _GROUP_TYPES[group]):
            msg = f"{group} must be a {_GROUP_TYPES[group].__name__}, not {type(value).__name__}"
            raise ValueError(msg)
    unknown = sorted(set(flat) - set(FLAT_KEYWORDS))
    if unknown:
        msg = (
            f"CraftEngine() got unexpected keyword arguments {unknown}; valid: "
            f"settings, planner, server, {', '.join(given)}, {', '.join(sorted(FLAT_KEYWORDS))}"
        )
        raise TypeError(msg)
    by_group: dict[str, dict[str, object]] = {group: {} for group in given}
    for name, value in flat.items():
        by_group[FLAT_KEYWORDS[name]][name] = value
    for group, values in by_group.items():
        if values and given[group] is not None:
            msg = (
                f"{', '.join(sorted(values))} and {group}= both given; pass "
                f"{'it' if len(values) == 1 else 'them'} inside {group}= or as keywords, not both"
            )
            raise ValueError(msg)
    return EngineParts(
        planners=planners or _make(PlannerSettings, by_group["planners"]),
        rendering=rendering or _make(RenderingSettings, by_group["rendering"]),
        conversation=conversation or _make(ConversationSettings, by_group["conversation"]),
        parts=parts or _make(BackendParts, by_group["parts"]),
    )


_GROUP_TYPES: Mapping[str, type] = {
    "planners": PlannerSettings,
    "rendering": RenderingSettings,
    "conversation": ConversationSettings,
    "parts": BackendParts,
}


def _make(group: Callable[..., _G], values: Mapping[str, object]) -> _G:
    """``group(**values)``: the keywords were checked against :data:`FLAT_KEYWORDS`, their
    types by :class:`FlatKeywords` at the call site."""
    return group(**values)
