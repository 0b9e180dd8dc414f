"""Reading back how many prompt tokens a request loaded from each KV tier.

:class:`craft_rag.kvtiers.connector.CraftTierConnector` reports them when a request finishes, in
vLLM's ``kv_transfer_params`` (in-process on ``RequestOutput.kv_transfer_params``; under the
OpenAI server in a non-streaming completion's ``kv_transfer_params``)::

    {"craft_tiers": {"ram_tokens": 256, "disk_tokens": 0}}

Framework-free (no vLLM): the engine's backends parse what comes back here. The dict crosses a
process (and, for a server, a network) boundary, so :func:`tier_tokens_of` trusts nothing but
non-negative ints under the two known keys; anything else reads as "no tier tokens".
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

__all__ = ["TIER_PARAMS_KEY", "TIER_TOKEN_KEYS", "tier_tokens_of"]

logger = logging.getLogger(__name__)

TIER_PARAMS_KEY = "craft_tiers"
"""Key of the per-request tier counts in ``kv_transfer_params``."""

TIER_TOKEN_KEYS = ("ram_tokens", "disk_tokens")
"""The counts under :data:`TIER_PARAMS_KEY`, in the order :func:`tier_tokens_of` returns them."""


def tier_tokens_of(params: object, *, maximum: int | None = None) -> tuple[int, int]:
    """``(ram_tokens, disk_tokens)`` from a request's ``kv_transfer_params``; ``(0, 0)`` when it
    holds no tier counts (no connector, a streaming server reply, another connector's params).

    Never raises: a malformed entry (not a mapping, an unknown key, a value that is not a
    non-negative int, or counts summing past ``maximum``, the prompt length when known) is
    logged at debug level and read as ``(0, 0)``, since a report must not fail a finished
    request. Other keys of ``params`` (another connector's) are ignored. O(1).
    """
    if not isinstance(params, Mapping):
        return 0, 0
    counts = params.get(TIER_PARAMS_KEY)
    if counts is None:
        return 0, 0
    if not isinstance(counts, Mapping) or not set(counts) <= set(TIER_TOKEN_KEYS):
        logger.debug("ignoring malformed %s in kv_transfer_params: %.200r", TIER_PARAMS_KEY, counts)
        return 0, 0
    values: list[int] = []
    for key in TIER_TOKEN_KEYS:
        value = counts.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            logger.debug(
                "ignoring %s.%s=%.100r (not a non-negative int)", TIER_PARAMS_KEY, key, value
            )
            return 0, 0
        values.append(value)
    ram, disk = values
    if maximum is not None and ram + disk > maximum:
        logger.debug(
            "ignoring %s: %d tier tokens > %d prompt tokens", TIER_PARAMS_KEY, ram + disk, maximum
        )
        return 0, 0
    return ram, disk
