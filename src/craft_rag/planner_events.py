"""Moved to :mod:`craft_rag.planner.feedback`; alias kept for one release.

The old module name is the new module itself (``sys.modules`` entry), so attribute reads and
``monkeypatch.setattr`` through either name see the same objects.
"""

import sys

import craft_rag.planner.feedback as _moved
from craft_rag.planner.feedback import *  # noqa: F403

sys.modules[__name__] = _moved
