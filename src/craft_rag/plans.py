"""Moved to :mod:`craft_rag.planner.plans`; alias kept for one release.

The old module name is the new module itself (``sys.modules`` entry), so attribute reads and
``monkeypatch.setattr`` through either name see the same objects.
"""

import sys

import craft_rag.planner.plans as _moved
from craft_rag.planner.plans import *  # noqa: F403

sys.modules[__name__] = _moved
