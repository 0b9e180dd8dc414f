"""Quiet engine start-up: one line from craft-rag instead of vLLM's import and start noise.

A first ``CraftEngine()`` used to print ~10 lines (a Triton notice logged while ``vllm`` is
imported, two ``FutureWarning``s from torch, a C++ NUMA notice, a weight-loading progress
bar) and then nothing for ~15-30 s. ``EngineSettings.log_level`` (the values of
``craft-rag serve --log-level``, default ``"error"``) now decides, for vLLM only:

* the ``vllm`` logger's level: set before ``vllm`` is imported (its import-time lines) and
  passed to ``vllm.LLM(log_level=...)``, which reconfigures only the ``vllm`` logger (its own
  handler, ``propagate=False``); the root logger and other libraries' loggers are untouched.
  The ``vllm`` logger keeps that level after the start, as ``VLLM_LOGGING_LEVEL`` would set it.
  Three other ways to see more stay honoured, the most verbose wins: a user's own
  ``VLLM_LOGGING_LEVEL``, the ``craft_rag`` logger set below WARNING
  (``logging.getLogger("craft_rag").setLevel(logging.INFO)``), and ``VLLM_CONFIGURE_LOGGING=0``
  (the user owns vLLM's logger: craft-rag leaves it alone).
* Python ``DeprecationWarning``/``FutureWarning``/``PendingDeprecationWarning``: ignored at
  ``"error"``/``"critical"``, only while the engine imports and starts
  (``warnings.catch_warnings``: the filters are restored afterwards, but while they are in
  place they hold for every thread of the process, as all warning filters do).
* vLLM's weight-loading progress bar (``use_tqdm_on_load=False`` at ``"error"``/``"critical"``;
  ``engine_kwargs`` override it).

No environment variable is set. One line remains that craft-rag cannot reach from Python: a
C++ notice from torch about NUMA memory binding on CPU (``TORCH_CPP_LOG_LEVEL=ERROR`` in the
environment before torch is imported hides it).

craft-rag adds one line of its own, :func:`start_progress`: at every level but ``"critical"``
a start is announced on stderr (or at INFO on ``craft_rag.engine`` when that logger is
enabled for INFO, i.e. the application configured logging), because a start takes 10-60 s on a
CPU and silence that long reads as a hang. vLLM users expect start-up lines by default (vLLM
prints INFO lines); LlamaIndex/LangChain users expect libraries to be quiet: one line per
engine start is the compromise, and ``"critical"`` silences it.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

LOGGER = logging.getLogger("craft_rag.engine")
#: The values of ``EngineSettings.log_level`` (and ``craft-rag serve --log-level``).
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_LOG_LEVEL = "error"
_NAMED_LEVELS = (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)
#: Warning categories ignored during a start at ``"error"``/``"critical"``: they come from
#: vLLM's, torch's and transformers' own code, and the caller cannot act on them.
NOISY_WARNINGS: tuple[type[Warning], ...] = (
    DeprecationWarning,
    PendingDeprecationWarning,
    FutureWarning,
)


#: How long a start takes, as the start line says it.
START_ESTIMATE = "usually 10-60 s on a CPU; longer on a busy machine"


def check_log_level(value: object) -> str:
    """``value`` if it is one of :data:`LOG_LEVELS`, else ``ValueError`` naming them."""
    if not isinstance(value, str) or value not in LOG_LEVELS:
        msg = f"log_level must be one of {', '.join(LOG_LEVELS)}, got {value!r}"
        raise ValueError(msg)
    return value


def vllm_log_level(log_level: str, environ: Mapping[str, str] | None = None) -> int:
    """The level vLLM logs at for ``log_level``: the most verbose of ``log_level``, a user's
    ``VLLM_LOGGING_LEVEL`` (``environ``, default ``os.environ``) and the ``craft_rag``
    logger's level when set below WARNING, as one of the named levels (DEBUG..CRITICAL).
    Pure apart from reading the logger; cheap."""
    level = logging.getLevelName(check_log_level(log_level).upper())
    assert isinstance(level, int)
    env = (os.environ if environ is None else environ).get("VLLM_LOGGING_LEVEL", "")
    from_env = logging.getLevelName(env.strip().upper()) if env.strip() else None
    if isinstance(from_env, int):
        level = min(level, from_env)
    craft = logging.getLogger("craft_rag").getEffectiveLevel()
    if craft < logging.WARNING:
        level = min(level, craft)
    # vLLM accepts only the named levels: a custom one (15) becomes the next more verbose.
    return max((n for n in _NAMED_LEVELS if n <= level), default=logging.DEBUG)


def vllm_configures_logging(environ: Mapping[str, str] | None = None) -> bool:
    """Whether vLLM applies its own logging configuration (``VLLM_CONFIGURE_LOGGING``, default
    on); when off, the user owns the ``vllm`` logger and craft-rag does not touch it."""
    value = (os.environ if environ is None else environ).get("VLLM_CONFIGURE_LOGGING", "1")
    return value.strip() not in ("0", "false", "False")


def is_quiet(log_level: str) -> bool:
    """Whether ``log_level`` hides warnings and progress bars (``"error"``, ``"critical"``)."""
    return LOG_LEVELS.index(check_log_level(log_level)) >= LOG_LEVELS.index("error")


@contextmanager
def quiet_start(level: int, *, hide_warnings: bool) -> Iterator[None]:
    """While the engine imports and starts: the ``vllm`` logger at ``level`` (when vLLM
    configures its own logging, see :func:`vllm_configures_logging`) and, with
    ``hide_warnings``, :data:`NOISY_WARNINGS` ignored. The warning filters are restored on
    exit; the ``vllm`` logger keeps ``level`` (``vllm.LLM(log_level=...)`` sets it anyway)."""
    if vllm_configures_logging():
        logging.getLogger("vllm").setLevel(level)
    with warnings.catch_warnings():
        if hide_warnings:
            for category in NOISY_WARNINGS:
                warnings.filterwarnings("ignore", category=category)
        yield


def start_progress(what: str, log_level: str, model_path: str | None = None) -> Callable[[], None]:
    """Announce a slow start in one line and return ``done()``, which logs the time it took
    at INFO on ``craft_rag.engine``. The line goes to that logger at INFO when it is enabled
    for INFO, else to stderr unless ``log_level`` is ``"critical"`` (see the module
    docstring for why). ``model_path`` is shown by its folder name."""
    started = time.perf_counter()
    name = Path(model_path).name or model_path if model_path else None
    line = f"starting {what}" + (f" for {name}" if name else "") + f" ({START_ESTIMATE}) ..."
    if LOGGER.isEnabledFor(logging.INFO):
        LOGGER.info("%s", line)
    elif check_log_level(log_level) != "critical":
        print(f"craft-rag: {line}", file=sys.stderr, flush=True)

    def done() -> None:
        LOGGER.info("%s ready in %.1f s", what, time.perf_counter() - started)

    return done
