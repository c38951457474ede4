"""The expert kernel's rate against a bundle's size: calibrate's probe
(calibration.expert_size_probe) against a model converted at another width, the profile keys it
writes, and the simulator's rate (sim.expert_kernel) against hand-worked figures."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from profile_helpers import MACHINE, compute, storage
from sim_helpers import MB, hardware, model, routing_input, scenario

from calibration import expert_size_probe
from calibration.profile_values import hardware_toml, hardware_values, write_hardware
from contract.errors import BadInput
from sim.expert_kernel import expert_gbps
from sim.profiles import load_hardware
from sim.rate_curve import rate_at
from sim.replay import run_scenario

IO = dict(ssd_latency_ms=0.1, ssd_bandwidth_gbps=1e9, queue_depth=2)  # storage out of the way
CURVE = dict(expert_size_bytes=[0.5 * MB, 2 * MB], expert_size_gbps=[2.0, 1.0])


def test_a_rate_between_two_sizes_is_read_per_byte_in_log2_of_the_size():
    assert rate_at([1.0, 4.0], [2.0, 1.0], 0.5) == 2.0  # below the first size: held
    assert rate_at([1.0, 4.0], [2.0, 1.0], 8.0) == 1.0  # past the last: held
    # 2 is halfway from 1 to 4 in log2: the time per byte halfway, 1 / (0.5/2 + 0.5/1)
    assert rate_at([1.0, 4.0], [2.0, 1.0], 2.0) == pytest.approx(4 / 3)


def test_the_curve_carries_expert_gbps_to_the_models_bundle_size():
    hw = hardware(**IO, expert_gbps=1.5, **CURVE)
    assert expert_gbps(hw, 0.5 * MB) == pytest.approx(1.5)  # the curve's first size
    assert expert_gbps(hw, 2 * MB) == pytest.approx(1.5 * 1.0 / 2.0)
    assert expert_gbps(hw, 1 * MB) == pytest.approx(1.5 * (4 / 3) / 2.0)
    assert expert_gbps(hardware(**IO, **CURVE), 2 * MB) == pytest.approx(1.0)  # curve alone
    assert expert_gbps(hardware(**IO, expert_gbps=1.5), 64 * MB) == 1.5  # no curve


@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_a_step_computes_its_experts_at_the_curves_rate_whatever_the_in_decode_factor(factor):
    """2 layers x K=2 bundles of 1 MiB, expert_gbps 1.5 at the curve's 0.5 MiB: at 1 MiB the
    curve gives 1.5 x (4/3) / 2 = 1 GB/s, so each layer's experts take 2 MiB / 1 GB/s. The
    in-decode compute_factor scales the fixed part (expert_overhead_ms), not the bytes."""
    m = model(layers=2, experts=16, k=2, build_ms_per_layer=0.0, resident_bytes=0)
    router = np.array([[[0, 1], [0, 1]]] * 6, dtype=np.int16)  # warm after the first step

    def evals(**hw) -> list[float]:
        sc = scenario(hw=hardware(**IO, mem_bandwidth_gbps=1e6, compute_factor=factor, **hw),
                      m=m, path="exact", decode_steps=6)
        steps = run_scenario(sc, routing=routing_input(router)).trace.steps
        return steps.filter(pl.col("phase") == "decode")["eval_ns"].to_list()[1:]

    with_curve = evals(expert_gbps=1.5, expert_overhead_ms=0.1, **CURVE)
    without = evals(expert_gbps=1.5, expert_overhead_ms=0.1)
    per_layer = 2 * MB / 1e9 * 1e9 + 0.1e6 * factor  # ns
    assert with_curve == [pytest.approx(2 * per_layer, rel=1e-3)] * len(with_curve)
    assert without == [pytest.approx(2 * (2 * MB / 1.5 + 0.1e6 * factor), rel=1e-3)] \
        * len(without)


def test_scaled_shapes_are_what_convert_writes_for_a_model_of_that_width(tmp_path,
                                                                       tiny_random_converted):
    """tiny-random (intermediate 128) scaled to 512 against the same architecture built by
    mlx-lm at 512 and converted: the same tensors, shapes and bytes."""
    from engine.convert import convert
    from engine.fixtures.random_models import build_random, small_config
    from engine.loader import open_manifest
    from engine.store import ExpertStore

    def shapes_of(converted):
        manifest = open_manifest(converted, verify=False)
        with ExpertStore(manifest) as store:
            return store.expert_shapes(manifest.moe_layers[0]), manifest.bundle_bytes

    cfg = small_config("qwen3_moe")
    cfg.update(num_hidden_layers=1, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=512)
    wide = tmp_path / "wide-stream"
    convert(build_random("qwen3_moe", tmp_path / "wide", 0, cfg), wide)
    small, small_bytes = shapes_of(tiny_random_converted)
    want, want_bytes = shapes_of(wide)
    got = expert_size_probe.scaled_shapes(small, 128, 512)
    assert got == want
    assert expert_size_probe.bundle_bytes(small) == small_bytes
    assert expert_size_probe.bundle_bytes(got) == want_bytes
    with pytest.raises(ValueError, match="does not scale"):
        expert_size_probe.scaled_shapes(small, 128, 100)


def test_the_probe_times_the_kernel_at_each_width(tiny_random_converted):
    """One measurement at widths 1 and 4: the model's own bundle first, then 4x its bytes;
    per-call times that grow with K (the slope the rate comes from)."""
    from engine.loader import open_manifest

    curve = expert_size_probe.expert_size_curve(tiny_random_converted, widths=(1, 4),
                                                repeats=1)
    bundle = open_manifest(tiny_random_converted, verify=False).bundle_bytes
    assert [size for size, _ in curve] == [bundle, 4 * bundle]
    for _, ms in curve:
        assert sorted(ms) == [1, 2, 4, 8]
        assert all(v > 0 for v in ms.values())


def test_calibrate_writes_the_curve_and_a_bad_curve_is_one_line(tmp_path):
    curve = [(61_440, {1: 0.08, 2: 0.14, 4: 0.26}), (245_760, {1: 0.3, 2: 0.55, 4: 1.05})]
    values = hardware_values(storage(), compute(expert_size_curve=curve), MACHINE,
                             active_params=1e6)
    assert values["expert_size_bytes"][0] == [61_440, 245_760]
    # bundle bytes over the per-expert slope of a least-squares line through K = 1, 2, 4
    slopes = [np.polyfit([1, 2, 4], [ms[k] for k in (1, 2, 4)], 1)[0] for _, ms in curve]
    want = [size / (s / 1e3) / 1e9 for (size, _), s in zip(curve, slopes, strict=True)]
    assert values["expert_size_gbps"][0] == pytest.approx(want, abs=1e-3)
    path = write_hardware(tmp_path / "cal.toml", hardware_toml(values, "cal", "now", "t"))
    assert load_hardware(str(path)).expert_size_bytes == [61_440, 245_760]
    bad = path.read_text().replace("expert_size_gbps = [", "expert_size_gbps = [1.0, ")
    path.write_text(bad)
    with pytest.raises(BadInput, match=r"cal.toml: expert_size_gbps: 3 values for 2 sizes"):
        load_hardware(str(path))
