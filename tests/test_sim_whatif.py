"""What-ifs that must bend the way physics does, on the paper's machines and on this one:
decode speed never falls when the SSD gets faster or RAM grows, it saturates once every expert
fits in the page cache, and at a fixed RAM an app cache that keeps growing eventually costs,
because every byte it pins is taken from the page cache (then from other processes, down to what
they give way to, then from the engine itself)."""

from __future__ import annotations

import pytest

from sim.profiles import load_scenario
from sim.replay import run_scenario
from sim.scenario import GIB

SCENARIOS = {  # name -> arms (extra --set items)
    "paper-m2-16gb": [["lead=none"], ["lead=token"]],
    "paper-m4pro-24gb": [["lead=none"], ["lead=token"]],
    "this-machine-tiny-trained": [[], ["path=hot", "lru_bytes=4MiB", "readers=2",
                                       "lookahead=true"]],
}
STEPS = 150


def _tok_s(name: str, sets: list[str]) -> tuple[float, dict]:
    res = run_scenario(load_scenario(name, [f"decode_steps={STEPS}", *sets]))
    return res.metrics["decode_tok_s"], res.figures.as_dict()


def _cases():
    return [(name, arm) for name, arms in SCENARIOS.items() for arm in arms]


def _ids():
    return [f"{name}:{' '.join(arm) or 'default'}" for name, arm in _cases()]


@pytest.mark.slow
@pytest.mark.parametrize("name,arm", _cases(), ids=_ids())
def test_decode_never_slows_as_the_ssd_gets_faster(name, arm):
    rates = [0.05, 0.2, 0.8, 3.2, 12.8]  # GB/s
    speeds = [_tok_s(name, [*arm, f"ssd_bandwidth_gbps={r}"])[0] for r in rates]
    assert all(b >= a * 0.999 for a, b in zip(speeds, speeds[1:], strict=False)), speeds
    assert speeds[-1] > speeds[0]  # and storage speed matters at all on these profiles


@pytest.mark.slow
@pytest.mark.parametrize("name,arm", _cases(), ids=_ids())
def test_decode_never_slows_with_more_ram_and_saturates_once_the_experts_fit(name, arm):
    sc = load_scenario(name, [*arm])
    hw = sc.hardware
    expert_gib = sc.model.expert_bytes / GIB
    fits = hw.os_reserve_gib + expert_gib + 4.0  # engine memory: a few GiB at most
    # from just above the least RAM the scenario accepts: where the OS gives way (the Macs'
    # os_floor_gib), below its reserve, the engine pages there and decode is slowest
    least_os = hw.os_reserve_gib if hw.os_floor_gib < 0 else hw.os_floor_gib
    floor = least_os + sc.model.resident_bytes / GIB + 0.5
    ram = [floor + (fits - floor) * f for f in (0.0, 0.25, 0.5, 0.75, 1.0)] + [fits * 2]
    runs = [_tok_s(name, [*arm, f"ram_gib={r:.3f}"]) for r in ram]
    speeds = [s for s, _ in runs]
    assert all(b >= a * 0.999 for a, b in zip(speeds, speeds[1:], strict=False)), speeds
    # once every expert fits in the page cache, more RAM changes nothing: the floor is
    # compute plus warm loads, and the only cold reads are each bundle's first
    assert speeds[-1] == pytest.approx(speeds[-2], rel=1e-9)
    assert runs[-1][1]["memory"]["page_cache"] >= sc.model.expert_bytes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["paper-m2-16gb", "paper-m4pro-24gb"])
def test_a_growing_app_cache_eventually_costs_at_fixed_ram(name):
    sc = load_scenario(name, ["path=hot", "lead=none", "readers=2"])
    hw = sc.hardware
    least_os = hw.os_reserve_gib if hw.os_floor_gib < 0 else hw.os_floor_gib  # OS gives way
    room = hw.ram_gib - least_os - sc.model.resident_bytes / GIB
    sizes = [room * f for f in (0.05, 0.15, 0.3, 0.5, 0.7, 0.9, 1.1)]
    runs = [_tok_s(name, ["path=hot", "lead=none", "readers=2", f"lru_bytes={s:.3f}GiB"])
            for s in sizes]
    speeds = [s for s, _ in runs]
    best = max(range(len(speeds)), key=speeds.__getitem__)
    assert best < len(speeds) - 1, speeds  # the biggest cache is not the best
    assert speeds[-1] < 0.9 * speeds[best], speeds
    # past the RAM left, the engine itself is paged out and faults it back in
    assert runs[-1][1]["memory"]["oversubscribed"] > 0 and runs[-1][1]["swap_faults"] > 0
    assert runs[best][1]["swap_faults"] == 0
