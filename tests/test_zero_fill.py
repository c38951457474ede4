"""The exact path's zeroed stack against how much memory a step touches: calibrate's probe
(calibration.zero_fill_probe), the profile keys it writes, and the simulator's rate
(sim.zero_fill), each against hand-worked figures."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import polars as pl
import pytest
from profile_helpers import MACHINE, compute, storage
from sim_helpers import MB, hardware, model, routing_input, scenario

from calibration import zero_fill_probe
from calibration.profile_values import hardware_toml, hardware_values, write_hardware
from contract.errors import BadInput
from sim.profiles import load_hardware
from sim.replay import run_scenario
from sim.zero_fill import fill_gbps, step_touched_bytes

IO = dict(ssd_latency_ms=0.1, ssd_bandwidth_gbps=1e9, queue_depth=2)  # storage out of the way
CURVE = dict(zero_fill_rotation_mib=[2.0, 64.0], zero_fill_rotation_gbps=[20.0, 8.0])


def test_the_rate_is_the_curve_read_at_the_rotation():
    hw = hardware(**IO, zero_fill_gbps=20.0, **CURVE)
    assert fill_gbps(hw, 1 * 2**20) == 20.0  # below the first rotation: held
    assert fill_gbps(hw, 2 * 2**20) == 20.0
    assert fill_gbps(hw, 64 * 2**20) == pytest.approx(8.0)
    assert fill_gbps(hw, 1024 * 2**20) == 8.0  # past the last: held
    # halfway in log2 (2 -> 64 MiB: 2^3.5 MiB), the time per byte halfway: 1/(0.5/20 + 0.5/8)
    assert fill_gbps(hw, 2**3.5 * 2**20) == pytest.approx(1 / (0.5 / 20 + 0.5 / 8))
    assert fill_gbps(hardware(**IO, zero_fill_gbps=5.0), 1e12) == 5.0  # no curve


def test_a_step_touches_its_stacks_their_source_pages_and_the_resident_weights():
    m = model(layers=6, experts=64, k=4, bundle_bytes=61_440, resident_bytes=1_000_000)
    assert step_touched_bytes(m, 4) == 2 * 6 * 4 * 61_440 + 1_000_000
    assert step_touched_bytes(m, 2) == 2 * 6 * 2 * 61_440 + 1_000_000


@pytest.mark.parametrize("rotations, want_gbps", [
    ([64.0, 128.0], 4.0),  # the step (8 MiB + weights) fits before the first rotation
    ([1.0, 2.0], 1.0),  # it touches more than the last: memory's rate
])
def test_the_exact_path_fills_at_the_rate_its_step_leaves(rotations, want_gbps):
    """2 layers x K=2 x 1 MiB stacks (8 MiB touched a step with their source pages): the
    exact path's graph building grows by 2 x 2 MiB at the curve's rate there, against no fill;
    nothing else moves."""
    m = model(layers=2, experts=16, k=2, build_ms_per_layer=0.5, resident_bytes=0)
    router = np.array([[[0, 1], [2, 3]]] * 6, dtype=np.int16)

    def steps(**fill) -> pl.DataFrame:
        sc = scenario(hw=hardware(**IO, **fill), m=m, path="exact", decode_steps=6)
        return run_scenario(sc, routing=routing_input(router)).trace.steps.filter(
            pl.col("phase") == "decode")

    without = steps()
    curved = steps(zero_fill_gbps=4.0, zero_fill_rotation_mib=rotations,
                   zero_fill_rotation_gbps=[4.0, 1.0])
    assert curved["blocked_ns"].to_list() == without["blocked_ns"].to_list()
    extra = (curved["build_ns"] - without["build_ns"]).to_list()
    assert extra == [pytest.approx(2 * 2 * MB / (want_gbps * 1e9) * 1e9, abs=2)] * 6


def test_calibrate_writes_the_curve_and_a_bad_curve_is_one_line(tmp_path):
    curve = [(2.0, 0.05), (32.0, 0.125)]  # ms per MiB
    values = hardware_values(storage(), compute(zero_fill_curve=curve), MACHINE,
                             active_params=1e6)
    gbps = [2**20 / (ms * 1e6) for _, ms in curve]
    assert values["zero_fill_rotation_mib"][0] == [2.0, 32.0]
    assert values["zero_fill_rotation_gbps"][0] == pytest.approx(gbps, abs=1e-3)
    assert values["zero_fill_gbps"][0] == pytest.approx(gbps[0], abs=1e-3)  # in the caches
    path = write_hardware(tmp_path / "cal.toml", hardware_toml(values, "cal", "now", "t"))
    hw = load_hardware(str(path))
    assert hw.zero_fill_rotation_mib == [2.0, 32.0]
    assert "zero_fill_rotation_mib" not in hardware_values(storage(), compute(), MACHINE,
                                                           active_params=1e6)
    text = path.read_text()
    for old, new, problem in [
        ("zero_fill_rotation_gbps = [20.972, 8.389]", "zero_fill_rotation_gbps = [20.972]",
         "zero_fill_rotation_gbps: 1 values for 2 rotations"),
        ("zero_fill_rotation_mib = [2.0, 32.0]", "zero_fill_rotation_mib = [32.0, 2.0]",
         "zero_fill_rotation_mib: .* ascending"),
        ("zero_fill_rotation_gbps = [20.972, 8.389]", "zero_fill_rotation_gbps = [20.972, 0]",
         "zero_fill_rotation_gbps: .* must be > 0"),
    ]:
        assert old in text
        bad = tmp_path / "bad.toml"
        bad.write_text(text.replace(old, new))
        with pytest.raises(BadInput, match=f"^{bad}: {problem}") as err:
            load_hardware(str(bad))
        assert "\n" not in str(err.value)


def test_the_probe_reuses_a_buffer_freed_that_many_bytes_before(monkeypatch):
    """_fill_ms keeps rotation / stack - 1 stacks alive, so each timed call's buffer was freed
    a rotation's bytes earlier (MLX's allocator hands the freed one back)."""
    live: list[weakref.ref] = []
    seen: list[int] = []

    class Stack:
        pass

    def alloc_stack(shapes, rows):
        gc.collect()
        seen.append(sum(r() is not None for r in live))
        stack = Stack()
        live.append(weakref.ref(stack))
        return stack, {}

    monkeypatch.setattr("engine.paths.kernel.alloc_stack", alloc_stack)
    zero_fill_probe._fill_ms({}, 1, rotation_bytes=8 * MB, stack_bytes=2 * MB)
    assert seen[-zero_fill_probe.TIMED:] == [3] * zero_fill_probe.TIMED  # 8 MiB: 3 alive + 1
    seen.clear()
    zero_fill_probe._fill_ms({}, 1, rotation_bytes=1 * MB, stack_bytes=2 * MB)
    assert seen == [0] * (1 + zero_fill_probe.TIMED)


def test_the_curve_is_the_stack_less_a_one_bundle_call_per_byte(monkeypatch, tmp_path):
    """alloc_stack timed as 0.1 ms a call + MiB x a rate that falls past 16 MiB of rotation:
    each rotation's figure is (the 2 MiB stack - the one-bundle call) / the MiB between them,
    so the per-call cost cancels: (2 r - r1 / 16) / (2 - 1 / 16) ms per MiB, r1 = 0.05 the
    one-bundle call's rate."""
    per_mib = {2: 0.05, 16: 0.05, 128: 0.125}

    def fill_ms(shapes, rows, rotation_bytes, stack_bytes):
        rate = per_mib.get(round(rotation_bytes / 2**20), 0.05)
        return 0.1 + stack_bytes / 2**20 * rate

    class Manifest:
        bundle_bytes = 65_536  # 1/16 MiB: the stack is 32 bundles
        moe_layers = [0]

    class Store:
        def __init__(self, manifest):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def expert_shapes(self, layer):
            return {}

    monkeypatch.setattr(zero_fill_probe, "_fill_ms", fill_ms)
    monkeypatch.setattr(zero_fill_probe, "ExpertStore", Store)
    monkeypatch.setattr("engine.loader.open_manifest", lambda path, verify: Manifest())
    curve = zero_fill_probe.zero_fill_curve(tmp_path, rotations_mib=(2, 16, 128))
    by_hand = [(2 * r - 0.05 / 16) / (2 - 1 / 16) for r in (0.05, 0.05, 0.125)]
    assert [mib for mib, _ in curve] == [2.0, 16.0, 128.0]
    assert [ms for _, ms in curve] == pytest.approx(by_hand)
    assert by_hand[0] == pytest.approx(0.05)
