"""Request scheduling ahead of the engine: cache-aware admission (:mod:`.admission`)."""

from craft_rag.scheduling.admission import (
    ADMISSION_POLICIES,
    DEFAULT_ADMISSION,
    DEFAULT_WINDOW,
    PRIORITY_SCALE,
    AdmissionOrder,
    AdmissionPolicy,
    AdmissionQueue,
    Admitted,
    CacheAware,
    FirstComeFirstServed,
    get_admission_policy,
)

__all__ = [
    "ADMISSION_POLICIES",
    "DEFAULT_ADMISSION",
    "DEFAULT_WINDOW",
    "PRIORITY_SCALE",
    "AdmissionOrder",
    "AdmissionPolicy",
    "AdmissionQueue",
    "Admitted",
    "CacheAware",
    "FirstComeFirstServed",
    "get_admission_policy",
]
