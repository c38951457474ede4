"""Running slow after idling (sim.idle_slowdown, its use in sim.cpu.Cores) and the probe that
measures it (calibration.idle_probe), against hand-worked numbers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import simpy
from sim_helpers import hardware

from contract.errors import BadInput
from sim.cpu import Cores
from sim.idle_slowdown import PELT_HALF_LIFE_MS, IdleSlowdown

HALF = PELT_HALF_LIFE_MS / 1e3


def test_the_average_halves_per_half_life_idle_and_recovers_running():
    """From busy (1), 32 ms idle leaves 0.5, 64 ms 0.25; then 32 ms running closes half the
    gap to 1: 0.625."""
    s = IdleSlowdown("hw", [0.5], [0.1])
    s.advance(HALF, False)
    assert s.util == pytest.approx(0.5)
    s.advance(2 * HALF, False)
    assert s.util == pytest.approx(0.25)
    s.advance(3 * HALF, True)
    assert s.util == pytest.approx(0.625)


def test_the_curve_is_linear_between_its_points_and_flat_beyond():
    s = IdleSlowdown("hw", [0.4, 0.8], [0.5, 0.0])
    for util, factor in ((0.1, 1.5), (0.4, 1.5), (0.6, 1.25), (0.8, 1.0), (1.0, 1.0)):
        s.util = util
        assert s.factor() == pytest.approx(factor)
    assert IdleSlowdown("hw", [], []).factor() == 1.0


def test_a_curve_of_another_length_or_out_of_range_is_one_clear_line(tmp_path):
    from sim.profiles import load_hardware

    with pytest.raises(BadInput, match="hardware x: idle_slowdown has 1 values for 2"):
        IdleSlowdown("hardware x", [0.2, 0.5], [0.1])
    text = Path("scenarios/hardware/this-machine.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text("\n".join(line for line in text.splitlines()
                             if not line.startswith(("idle_util_points", "idle_slowdown")))
                   + "\nidle_util_points = [0.5, 1.5]\nidle_slowdown = [0.2, 0.0]\n")
    with pytest.raises(BadInput, match=r"bad.toml: idle_util_points: \[0.5, 1.5\] must be"):
        load_hardware(bad)


def test_each_decode_loop_takes_its_own_curve():
    hw = hardware(idle_util_points=[0.5], idle_slowdown=[0.3],
                  sync_idle_util_points=[0.5], sync_idle_slowdown=[0.1])
    assert IdleSlowdown.for_loop(hw, lookahead=True).factor() == pytest.approx(1.3)
    assert IdleSlowdown.for_loop(hw, lookahead=False).factor() == pytest.approx(1.1)
    assert not IdleSlowdown.for_loop(hardware(), lookahead=True).enabled


@pytest.mark.parametrize("threads", [1, 3])  # the unbounded shortcut, and processor sharing
def test_work_after_an_idle_spell_takes_longer(threads):
    """2 cores, curve 0.5 -> +40%, 1 -> 0. A 1 ms job at 0 runs at full speed (the process
    starts busy); 32 ms idle after it halve the average, so a 1 ms job at 33 ms takes 1.4 ms
    and ends at 34.4 ms. Without the curve it ends at 34.0 ms."""
    def run(curve: tuple[list[float], list[float]]) -> list[float]:
        env = simpy.Environment()
        cores = Cores(env, 2, threads=threads, idle=IdleSlowdown("hw", *curve))
        ends = []

        def job():
            yield cores.work(1e-3)
            ends.append(env.now)
            yield env.timeout(HALF)
            yield cores.work(1e-3)
            ends.append(env.now)

        env.process(job())
        env.run()
        return ends

    assert run(([0.5, 1.0], [0.4, 0.0])) == pytest.approx([1e-3, 34.4e-3])
    assert run(([], [])) == pytest.approx([1e-3, 34e-3])


def test_a_job_running_keeps_the_average_up():
    """A 10 ms job keeps the process busy: a second job that starts at its end, with no gap,
    runs at full speed even on a curve that slows anything under 1."""
    env = simpy.Environment()
    cores = Cores(env, 2, threads=3, idle=IdleSlowdown("hw", [0.99, 1.0], [1.0, 0.0]))
    ends = []

    def job():
        yield cores.work(10e-3)
        yield cores.work(1e-3)
        ends.append(env.now)

    env.process(job())
    env.run()
    assert ends == pytest.approx([11e-3])


# ------------------------------------------------------------------ the probe


def test_the_probe_sleeps_inside_even_blocks_only():
    from calibration.idle_probe import BLOCK, since_sleep, sleeps_after

    assert [c for c in range(1, 2 * BLOCK + 10) if sleeps_after(c, 8)] == \
        [8, 16, 24, 2 * BLOCK + 8]
    after = since_sleep(2 * BLOCK, 8)
    # the sleep after the 8th step falls inside step 8's window (0-based), then 16, 24
    assert after[:9] == [None] * 8 + [0]
    assert after[24] == 0 and after[25] == 1 and after[47] == 23
    assert not any(sleeps_after(c, 0) for c in range(1, 100))


def _idle_run(every: int, sleep_ms: float, step_ms: float, work: list[float]):
    from calibration.idle_probe import IdleRun

    rows, t = [], 0
    for w in work:
        rows.append((t, t + int(step_ms * 1e6), int(w * 1e6)))
        t += int(step_ms * 1e6)
    return IdleRun(sleep_ms, every, Path("."), rows, {})


def test_the_probe_average_follows_the_timeline():
    """10 ms steps; step 8's window is 42 ms, a 32 ms sleep at its start and 10 ms of running:
    the average is 1 up to it, 0.5 after the sleep, at the step's middle (5 ms of running)
    1 - 0.5 e^(-5/tau), and at the next step's middle 1 - 0.5 e^(-15/tau)."""
    from calibration.idle_probe import utilization

    run = _idle_run(8, 32.0, 10.0, [5.0] * 10)
    run.rows[8] = (run.rows[8][0], run.rows[8][0] + 42_000_000, 5_000_000)
    u = utilization(run)
    tau = PELT_HALF_LIFE_MS / math.log(2)
    assert u[:8] == pytest.approx([1.0] * 8)
    assert u[8] == pytest.approx(1 - 0.5 * math.exp(-5 / tau))
    assert u[9] == pytest.approx(1 - 0.5 * math.exp(-15 / tau))


def test_the_probe_point_is_the_slowdown_against_the_same_captures_far_steps():
    """Every 8 steps in the sleeping blocks: a step right after a sleep takes 6 ms of build +
    eval, the next RECOVERY - 1 steps 5 ms, the rest 4 ms (the reference: more than RECOVERY
    steps from a sleep): slowdowns +50%, then +25%, one per step after a sleep; the far steps
    scatter by none. (The steps near a sleep outnumber the far ones: a reference over every
    step would be 5 ms.)"""
    from calibration.idle_probe import BLOCK, RECOVERY, run_steps, since_sleep

    after = since_sleep(4 * BLOCK, 8)
    work = [4.0 if p is None or p > RECOVERY else 6.0 if p == 1 else 5.0 for p in after]
    steps, far = run_steps(_idle_run(8, 60.0, 10.0, work))
    assert sorted(steps) == list(range(1, RECOVERY + 1))
    assert len(steps[1]) == after.count(1) == 6  # 3 sleeps in each of 2 sleeping blocks
    assert [y for _, y in steps[1]] == pytest.approx([0.5] * 6)
    assert [y for _, y in steps[2]] == pytest.approx([0.25] * 6)
    assert [y for _, y in steps[RECOVERY]] == pytest.approx([0.25] * len(steps[RECOVERY]))
    assert len(far) == sum(p is not None and p > RECOVERY for p in after)
    assert far == pytest.approx([0.0] * len(far))


def _fake_curve(points: dict[int, list[float]], scatter: list[float]):
    """curve() over one capture whose steps after a sleep are `points` (position -> each
    step's slowdown, at average 0.1 x position) and whose far steps scatter by `scatter`."""
    import calibration.idle_probe as probe

    original = probe.run_steps
    probe.run_steps = lambda run: ({pos: [(0.1 * pos, y) for y in ys]
                                    for pos, ys in points.items()}, scatter)
    try:
        return probe.curve([probe.IdleRun(60.0, 8, Path("."), [], {})], 1, "hot")
    finally:
        probe.run_steps = original


def test_the_curve_is_pooled_non_increasing_and_ends_at_its_first_zero():
    """Points of one step each, the far steps without scatter: (u, slowdown) 0.4: 0.3,
    0.5: 0.1, 0.6: 0.2 (a violation: 0.5 and 0.6 pooled to (0.55, 0.15)), 0.7: 0.03 and
    0.8: 0.06 (another violation, pooled to (0.75, 0.045): under the probe's noise floor, so
    0, and the curve ends there)."""
    c = _fake_curve({4: [0.3], 5: [0.1], 6: [0.2], 7: [0.03], 8: [0.06]}, [0.0] * 9)
    assert c.util == pytest.approx([0.4, 0.55, 0.75])
    assert c.slowdown == pytest.approx([0.3, 0.15, 0.0])


def test_pooling_weighs_each_point_by_its_steps():
    """0.5: +10% over 3 steps, 0.6: +20% over 1: pooled to (0.525, 0.125), not the plain mean
    (0.55, 0.15). The median of a point's steps: 0.1, 0.1, 0.4 gives 0.1."""
    c = _fake_curve({5: [0.1, 0.1, 0.4], 6: [0.2]}, [0.0] * 9)
    assert c.util[0] == pytest.approx(0.525)
    assert c.slowdown[0] == pytest.approx(0.125)
    assert [p["steps"] for p in c.points] == [3, 1]


def test_a_point_of_few_steps_must_stand_out_of_the_far_steps_scatter():
    """Far steps at -0.2, -0.1, 0, +0.1, +0.2: MAD 0.1, sigma 0.14826; Z = 2 standard errors of
    a median of n steps, 2 x 1.2533 x 0.14826 / sqrt(n): 0.372 for 1 step, 0.093 for 16. So
    +20% from one step is noise (the curve ends at once), from 16 steps it counts."""
    from calibration.idle_probe import noise

    scatter = [-0.2, -0.1, 0.0, 0.1, 0.2]
    assert noise(scatter, 1) == pytest.approx(2 * 1.2533 * 0.14826, rel=1e-4)
    assert noise(scatter, 16) == pytest.approx(2 * 1.2533 * 0.14826 / 4, rel=1e-4)
    assert noise([0.0] * 5, 16) == pytest.approx(0.05)  # never under the floor
    one = _fake_curve({3: [0.2]}, scatter)
    assert one.util == pytest.approx([0.3]) and one.slowdown == [0.0]
    many = _fake_curve({3: [0.2] * 16}, scatter)
    assert many.util == pytest.approx([0.3, 1.0]) and many.slowdown == pytest.approx([0.2, 0.0])
