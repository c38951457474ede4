"""reports/cross-machine/estimator_ab.py's CPU split, worked by hand."""

from __future__ import annotations

import pytest

from reports.load_script import load_script


def _point(cpu: tuple[float, float], main: tuple[float, float]) -> dict:
    return {"cpu_ms_per_step": {"measured": cpu[0], "simulated": cpu[1]},
            "main_cpu_ms_per_step": {"measured": main[0], "simulated": main[1]}}


def test_the_cpu_split_errors_are_per_thread_medians():
    ab = load_script("cross-machine/estimator_ab.py")
    # main thread: 4 -> 2 (50%), 5 -> 5 (0%), 10 -> 11 (10%): median 10%
    # the others (total less main): 6 -> 8 (33.3%), 5 -> 4 (20%), 10 -> 10 (0%): median 20%
    results = [_point((10, 10), (4, 2)), _point((10, 9), (5, 5)), _point((20, 21), (10, 11))]
    got = ab.cpu_split_errors(results)
    assert got == {"main_cpu_abs_error_median_pct": pytest.approx(10.0),
                   "other_cpu_abs_error_median_pct": pytest.approx(20.0)}
