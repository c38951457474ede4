"""The environment of a child Python process that must import one checkout of this project's
packages (its root first on PYTHONPATH), whatever the parent's current directory: the bench's
ARM@before workers run another checkout's engine, calibration's probes this one's. No MLX."""

from __future__ import annotations

import os
from pathlib import Path


def importing(root: str | Path) -> dict[str, str]:
    """This process's environment with `root` ahead of PYTHONPATH's other entries."""
    rest = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), rest]))}
