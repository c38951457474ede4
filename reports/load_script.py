"""A report's script as a module. Report folders are named for people (`token-lead`,
`cross-machine`), not as Python packages, so a script that another report or a test reuses is
loaded by its path."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPORTS = Path(__file__).resolve().parent


def load_script(relative: str) -> ModuleType:
    """reports/RELATIVE (e.g. "io/token-lead/run.py"), freshly executed as a module."""
    path = REPORTS / relative
    name = "report_" + relative.removesuffix(".py").replace("/", "_").replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a Python script")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
