"""reports/cross-machine/main_thread_cpu.py: each part's CPU exclusive of the parts inside it,
checked on busy loops whose CPU is known by construction."""

from __future__ import annotations

import time

import pytest

from reports.load_script import load_script


def _spin(ms: float) -> None:
    """Burn `ms` of this thread's CPU."""
    end = time.thread_time_ns() + ms * 1e6
    while time.thread_time_ns() < end:
        pass


def test_parts_are_exclusive_of_the_parts_inside_them():
    """outer spins 20 ms, calls inner (10 ms) twice, spins 10 ms: outer is charged 30 ms, inner
    20 ms, and together they are the 50 ms spent (a timer that forgets to subtract the nested
    part charges outer 50)."""
    parts = load_script("cross-machine/main_thread_cpu.py").Exclusive()
    inner = parts.wrap("inner", lambda: _spin(10))

    def body() -> None:
        _spin(20)
        inner()
        inner()
        _spin(10)

    outer = parts.wrap("outer", body)
    c0 = time.thread_time_ns()
    outer()
    spent = (time.thread_time_ns() - c0) / 1e6
    assert parts.total["inner"] / 1e6 == pytest.approx(20, abs=3)
    assert parts.total["outer"] / 1e6 == pytest.approx(30, abs=3)
    assert (parts.total["inner"] + parts.total["outer"]) / 1e6 == pytest.approx(spent, abs=0.5)
    assert not parts.stack  # every part closed, an exception or not


def test_a_part_that_raises_is_still_charged():
    parts = load_script("cross-machine/main_thread_cpu.py").Exclusive()

    def fail() -> None:
        _spin(5)
        raise ValueError("bad")

    with pytest.raises(ValueError):
        parts.wrap("fail", fail)()
    assert parts.total["fail"] / 1e6 == pytest.approx(5, abs=2)
    assert not parts.stack
