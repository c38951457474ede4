"""docs/simulator.md is generated from the dataclasses' metadata and current: every hardware,
model and scenario key appears with a unit, a meaning and how to obtain it."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from sim.key_reference import HIDDEN, markdown
from sim.scenario import Hardware, ModelProfile, Scenario

DOC = Path(__file__).resolve().parents[1] / "docs" / "simulator.md"


def test_the_committed_reference_is_current():
    assert DOC.read_text() == markdown(), \
        "docs/simulator.md is stale: uv run ssdmoe sim keys --write docs/simulator.md"


def test_every_key_has_a_meaning_and_a_source():
    for cls in (Hardware, ModelProfile, Scenario):
        for f in fields(cls):
            if f.name in HIDDEN:
                continue
            assert f.metadata.get("help"), (cls.__name__, f.name)
            assert f.metadata.get("obtain"), (cls.__name__, f.name)
            assert f"| `{f.name}` |" in markdown()


def test_a_reference_that_cannot_be_written_is_one_line(tmp_path, ssdmoe):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = ssdmoe("sim", "keys", "--write", str(blocker / "simulator.md"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "cannot write" in lines[0], r.stderr
