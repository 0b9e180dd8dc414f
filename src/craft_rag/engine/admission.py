"""How an engine applies cache-aware admission (:mod:`craft_rag.scheduling.admission`).

Two ways, chosen by ``EngineSettings.admission_queue``:

- **vLLM's priority scheduler** (``admission_queue=None``, the default when ``admission`` is
  not ``"fcfs"``): every request goes to vLLM at once with ``priority=`` its admission key;
  the in-process engine is started with ``scheduling_policy="priority"``, and a vLLM server
  must run with ``--scheduling-policy priority`` (``craft-rag serve --admission cache_aware``
  starts it so). vLLM serves the lowest key first (ties by arrival) and has no aging of its
  own: the key carries the starvation bound. vLLM also preempts running requests of higher
  keys when KV memory runs short. Nothing is held by craft-rag (``held_ms`` is 0).
- **craft-rag's own queue** (``admission_queue=N``, in-process engine only): at most ``N``
  requests are in vLLM at a time; the others wait in an
  :class:`~craft_rag.scheduling.admission.AdmissionQueue` and enter lowest key first as
  requests finish. Works with vLLM's default FCFS scheduler; ``ReuseReport.admission_held_ms``
  says how long each request waited there. An error vLLM raises when a held request enters
  (e.g. a prompt too long) fails that request instead of its ``submit``.

Both orders are the same keys, so both keep the bound: no request is served after more than
``window - 1`` requests that arrived after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from craft_rag.scheduling.admission import (
    DEFAULT_ADMISSION,
    AdmissionOrder,
    get_admission_policy,
)
from craft_rag.validation import check_int, check_optional_int

__all__ = ["Admission", "AdmissionFields", "admission_of", "check_admission"]


class AdmissionFields(Protocol):
    """The admission fields of ``EngineSettings`` (a protocol: the settings module imports
    this one for its checks)."""

    @property
    def admission(self) -> str: ...

    @property
    def admission_window(self) -> int: ...

    @property
    def admission_queue(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class Admission:
    """An engine's admission: the key order (shared by every request of the engine) and, with
    ``max_running``, the size of craft-rag's own queue's gate (``None``: vLLM orders by
    priority)."""

    order: AdmissionOrder
    max_running: int | None = None

    @property
    def uses_priority(self) -> bool:
        """Whether requests go to vLLM with ``priority=`` (its priority scheduler orders them)."""
        return self.max_running is None

    def key(self, predicted_cached: int, prompt_tokens: int) -> int:
        """The next request's key; the prediction is clamped to the prompt. O(1)."""
        cached = max(0, min(predicted_cached, prompt_tokens))
        return self.order.key(cached, max(1, prompt_tokens))


def check_admission(policy: object, window: object, queue: object) -> None:
    """``ValueError`` naming the field for a bad ``admission`` (the valid names),
    ``admission_window`` (an int >= 1) or ``admission_queue`` (``None`` or an int >= 1)."""
    if not isinstance(policy, str):
        msg = f"admission must be a policy name (fcfs, cache_aware), got {policy!r}"
        raise ValueError(msg)
    get_admission_policy(policy)
    check_int(window, "admission_window", minimum=1)
    check_optional_int(queue, "admission_queue", minimum=1, none_means="vLLM's priority order")


def admission_of(settings: AdmissionFields) -> Admission | None:
    """The engine's admission, or ``None`` when off (``admission="fcfs"`` without a queue:
    requests go to vLLM as they come, unchanged)."""
    if settings.admission == DEFAULT_ADMISSION and settings.admission_queue is None:
        return None
    order = AdmissionOrder(settings.admission, settings.admission_window)
    return Admission(order, settings.admission_queue)
