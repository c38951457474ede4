"""The generators under reports/ keep working as the code moves: each compiles, and every name
it imports from this project exists (a renamed module or function fails here, not months later
when someone reruns a report). reports/ holds outputs and their generators only: no module
under reports/ shares its name with one of the project's packages' modules."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("contract", "engine", "sim", "traces", "ssdmoe_cli", "validation", "server",
        "calibration")


def _generators() -> list[Path]:
    return sorted((ROOT / "reports").rglob("*.py"))


def test_every_generator_compiles_and_its_imports_of_ours_exist():
    assert _generators()
    for path in _generators():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level \
                    and node.module.split(".")[0] in OURS:
                module = importlib.import_module(node.module)
                for alias in node.names:
                    submodule = hasattr(module, "__path__") and importlib.util.find_spec(
                        f"{node.module}.{alias.name}") is not None
                    assert hasattr(module, alias.name) or submodule, \
                        (path, node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in OURS:
                        importlib.import_module(alias.name)


def test_no_generator_shares_a_name_with_a_module_of_ours():
    ours = {f.stem for p in OURS for f in (ROOT / p).rglob("*.py") if f.stem != "__init__"}
    clash = [p.relative_to(ROOT).as_posix() for p in _generators()
             if p.stem in ours]
    assert clash == []
