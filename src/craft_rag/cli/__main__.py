"""``python -m craft_rag.cli``: the ``craft-rag`` command."""

from craft_rag.cli.entry import main

raise SystemExit(main())
