"""How served chunk-prefixes enter the CP-Tree after a request (paper §4.2 "Table Update").

Rules are tiny objects looked up by name in :data:`PROMOTION_RULES`:

- ``threshold`` (the paper): with no cached prefix reused, insert the longest leading run of the
  request whose chunks all reached the promotion threshold T in the CA-Table; when a cached prefix
  of length m was reused, extend it by the next chunk if that chunk reached T.
- ``served``: insert the whole served order. vLLM keeps the KV of every prompt it computed, so
  every served prefix is in fact reusable until evicted; this is what lets the ``tree`` policy give
  a repeated chunk set its cached order back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from craft_rag.access_table import ChunkAccessTable
from craft_rag.types import ChunkKey
from craft_rag.validation import from_registry, registry_by_name


@dataclass(frozen=True, slots=True)
class PromotionInput:
    """What a rule sees: the served order, the reused prefix length and the updated table."""

    ordered: Sequence[ChunkKey]
    matched: int
    access_table: ChunkAccessTable
    threshold: int


class PromotionRule(Protocol):
    name: str

    def promote(self, request: PromotionInput) -> int:
        """How many leading chunks of ``request.ordered`` form the path to insert (0: none)."""
        ...


class ThresholdPromotion:
    """Paper §4.2: promote a hot leading run, or extend a reused prefix by one hot chunk. O(k)."""

    name = "threshold"

    def promote(self, request: PromotionInput) -> int:
        ordered, matched, t = request.ordered, request.matched, request.threshold
        count = request.access_table.count
        if matched == 0:
            run = 0
            while run < len(ordered) and count(ordered[run]) >= t:
                run += 1
            return run
        if matched < len(ordered) and count(ordered[matched]) >= t:
            return matched + 1
        return 0


class ServedPromotion:
    """Insert the whole served order (every computed prefix is cached by vLLM). O(1)."""

    name = "served"

    def promote(self, request: PromotionInput) -> int:
        return len(request.ordered)


PROMOTION_RULES: Mapping[str, Callable[[], PromotionRule]] = registry_by_name(
    ThresholdPromotion, ServedPromotion
)


def get_promotion_rule(name: str) -> PromotionRule:
    """A new rule object by name; ``ValueError`` lists the valid names."""
    return from_registry(PROMOTION_RULES, name, "promotion rule")
