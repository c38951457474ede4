"""The README stays a front page (at most ~12 KB, its first lines the two commands) and every
relative link in it and in docs/ points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 12_500
    first = text.splitlines()[2:4]
    assert first[0].strip().startswith("bash scripts/demo.sh")
    assert first[1].strip().startswith("bash scripts/test.sh")


def test_every_relative_link_resolves():
    missing = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert missing == []
