"""Shared by the calibration tests: storage and compute measurements with known costs, a
machine's facts, and the round trip of one measured hardware figure through the profile."""

from __future__ import annotations

import pytest

from calibration.profile_values import MIB, ComputeResult, StorageResult, hardware_values
from sim.profiles import load_hardware

SIZES = [4096, 65536, MIB, 4 * MIB]
# what calibration.machine.facts() reads on a machine, fixed here
MACHINE = {"ram_gib": (16.0, "given"), "os_reserve_gib": (2.5, "given"),
           "cpu_cores": (2, "given"), "compute_on_cpu": (True, "given")}


def storage(a_w=0.004, memcpy=8.0, a_c=0.09, bw=1.5, latency=0.05) -> StorageResult:
    """Exactly linear read times: warm = a_w + s/memcpy, cold = a_c + s/bw + s/memcpy (ms)."""
    warm = [a_w + s / (memcpy * 1e9) * 1e3 for s in SIZES]
    cold = [a_c + s / (bw * 1e9) * 1e3 + s / (memcpy * 1e9) * 1e3 for s in SIZES]
    return StorageResult(SIZES, cold, warm, latency, 1.8, {1: 0.8, 2: 1.3, 4: 1.35, 8: 1.36},
                         "/tmp", 1 << 20)


def compute(**over) -> ComputeResult:
    values = dict(model="m", layers=4, experts=16, bundle_bytes=100_000, resident_bytes=2_000_000,
                  glu_ms={1: 0.3, 2: 0.5, 4: 0.9, 8: 1.7}, build_ms_per_layer=0.2,
                  engine_build_ms_per_layer=0.6, non_moe_ms=4.0, step_ms=7.6, sync_ms=0.25,
                  synced_compute_ms=8.6, path_build_ms_per_layer={"exact": 0.6},
                  prefill_ms=100.0, prefill_tokens=64, warm_bundle_ms=0.08,
                  cold_bundle_ms=0.9, cold_bundles=10, handoff_ms=0.04, handoff_p10_ms=0.03,
                  handoff_reps=100)
    values.update(over)
    return ComputeResult(**values)


def assert_profile_round_trip(tmp_path, key: str, value: float, how: dict[str, str],
                              bad: float, message: str) -> None:
    """A measured hardware figure (`key`, with the ComputeResult fields `how`) reaches the
    profile with its source, loads back, is left out when not measured, and a value out of
    its range (`bad`) is one clear line matching `message`."""
    from calibration.profile_values import hardware_toml, write_hardware
    from contract.errors import BadInput

    values = hardware_values(storage(), compute(**{key: value}, **how), MACHINE,
                             active_params=1e6)
    assert values[key][0] == value
    assert all(text in values[key][1] for text in how.values())
    path = write_hardware(tmp_path / "cal.toml",
                          hardware_toml(values, "cal", "now", "ssdmoe calibrate"))
    assert getattr(load_hardware(str(path)), key) == value
    assert key not in hardware_values(storage(), compute(), MACHINE, active_params=1e6)
    broken = tmp_path / "bad.toml"
    broken.write_text(path.read_text().replace(f"{key} = {value}", f"{key} = {bad}"))
    with pytest.raises(BadInput, match=message):
        load_hardware(str(broken))
