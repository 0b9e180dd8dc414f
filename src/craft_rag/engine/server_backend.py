"""Moved to :mod:`craft_rag.engine.backends.server.backend`; alias kept for one release.

The old module name is the new module itself (``sys.modules`` entry), so attribute reads and
``monkeypatch.setattr`` through either name see the same objects.
"""

import sys

import craft_rag.engine.backends.server.backend as _moved
from craft_rag.engine.backends.server.backend import *  # noqa: F403

sys.modules[__name__] = _moved
