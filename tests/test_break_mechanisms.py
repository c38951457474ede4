"""scripts/break_mechanisms.py breaks each simulated mechanism by replacing one exact piece of
its source. If the source moves on, that piece no longer matches and the mechanism silently
stops being checked: every piece must still occur exactly once, and each replacement must
change it."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = runpy.run_path(str(ROOT / "scripts" / "break_mechanisms.py"))["MUTANTS"]


def test_mechanism_names_are_unique() -> None:
    names = [name for name, *_ in MUTANTS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(("name", "rel", "old", "new"), MUTANTS, ids=[m[0] for m in MUTANTS])
def test_each_mutant_still_finds_its_line(name: str, rel: str, old: str, new: str) -> None:
    assert old != new, name
    assert (ROOT / rel).read_text().count(old) == 1, f"{name}: {rel} no longer has the line"
