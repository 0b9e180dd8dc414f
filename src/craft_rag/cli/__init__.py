"""The ``craft-rag`` command, a package above the engine (it registers the engine's
subcommands): :mod:`.entry` builds the parser and runs a command (``main``, the console
script), :mod:`.replay` is ``craft-rag replay``. Argument checks shared with other
distributions' subcommands live below the engine, in :mod:`craft_rag.cli_args`.
"""

from craft_rag.cli.entry import build_parser, main

__all__ = ["build_parser", "main"]
