"""Build a directory under a temporary name, then put it in place: a failed or interrupted build
never leaves a half-written model behind."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def build_into(dst: Path, tmp: Path, build: Callable[[Path], T]) -> T:
    """Run build(tmp) (tmp is removed first), then replace `dst` with `tmp`. On any error or
    interruption `tmp` is removed and `dst` is left as it was."""
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        result = build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dst.exists():
        shutil.rmtree(dst)
    tmp.rename(dst)
    return result
