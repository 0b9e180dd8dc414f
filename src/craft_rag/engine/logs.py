"""Quiet engine start-up: vLLM's log level follows craft-rag's, and one progress line.

vLLM configures its own ``vllm`` logger when imported (``VLLM_CONFIGURE_LOGGING``, level
``VLLM_LOGGING_LEVEL``, default INFO): ~35 lines per engine start. Libraries should follow the
application's logging configuration instead. :func:`align_vllm_logging` runs before vLLM is
imported (and again after, for a process that imported it earlier): unless the user set
``VLLM_LOGGING_LEVEL`` themselves, vLLM logs at the effective level of the ``craft_rag`` logger,
raised to ERROR while that is the unconfigured default (WARNING): vLLM's start-up warnings are
about its own internals (thread binding, deprecated prompt forms), not the caller's requests.
``logging.getLogger("craft_rag").setLevel(logging.INFO)`` brings all of vLLM's lines back.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable

LOGGER = logging.getLogger("craft_rag.engine")
_ENV = "VLLM_LOGGING_LEVEL"


def vllm_log_level() -> int:
    """The level vLLM should log at: craft-rag's effective level; ERROR for the default."""
    level = logging.getLogger("craft_rag").getEffectiveLevel()
    return logging.ERROR if level >= logging.WARNING else level


def align_vllm_logging() -> None:
    """Set vLLM's level from craft-rag's (see the module docstring); a user's own
    ``VLLM_LOGGING_LEVEL`` wins. Idempotent, cheap."""
    if _ENV in os.environ and os.environ.get("CRAFT_RAG_SET_VLLM_LEVEL") != "1":
        return
    level = vllm_log_level()
    os.environ[_ENV] = logging.getLevelName(level)
    os.environ["CRAFT_RAG_SET_VLLM_LEVEL"] = "1"
    if "vllm" in sys.modules:  # imported earlier: its handler exists, set the logger itself
        logging.getLogger("vllm").setLevel(level)


def start_progress(what: str) -> Callable[[], None]:
    """Announce a slow start (one line: INFO on ``craft_rag.engine`` when that is enabled,
    else on an interactive stderr) and return ``done()``, which logs the time it took at
    INFO. Nothing is printed to a non-interactive stderr by default."""
    started = time.perf_counter()
    if LOGGER.isEnabledFor(logging.INFO):
        LOGGER.info("starting %s ...", what)
    elif sys.stderr.isatty():
        print(f"craft-rag: starting {what} ...", file=sys.stderr, flush=True)

    def done() -> None:
        LOGGER.info("%s ready in %.1f s", what, time.perf_counter() - started)

    return done
