"""`ssdmoe calibrate` (calibration/): a model profile from a manifest matches the model, a short
real calibrate gives positive numbers, the GIL hand-over probe waits as a reader does, and the
kernel's page-cache policy is read off the machine, and the stall and idle probes capture
through the engine's own API. The fits: test_profile_values.py."""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from pathlib import Path

import pytest

from calibration import handover_probe
from calibration.compute_probes import PAGE_SPANS, expert_kernel_gbps
from calibration.profile_values import (
    hardware_toml,
    write_hardware,
)
from sim.model_profile import model_toml, profile_from_manifest, write_model
from sim.profiles import load_hardware, load_model


def _header(path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), n


def test_model_profile_from_a_manifest(tiny_random_converted, tmp_path):
    v = profile_from_manifest(tiny_random_converted, 0.3, "test")
    man = json.loads((tiny_random_converted / "manifest.json").read_text())
    cfg = man["config"]
    assert v["layers"][0] == cfg["num_hidden_layers"] == 4
    assert v["experts"][0] == 32 and v["k"][0] == 4 and v["bundle_bytes"][0] == man["bundle_bytes"]
    header, n = _header(tiny_random_converted / "resident.safetensors")
    size = (tiny_random_converted / "resident.safetensors").stat().st_size
    assert v["resident_bytes"][0] == size - 8 - n  # float32 tensors: held as stored
    h, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    resident_params = (size - 8 - n) // 4
    embed = cfg["vocab_size"] * h
    assert not cfg["tie_word_embeddings"]
    assert v["active_params"][0] == resident_params - embed + 4 * 4 * 3 * h * inter
    head_dim = cfg["head_dim"]
    assert v["kv_bytes_per_token"][0] == 2 * 4 * cfg["num_key_value_heads"] * head_dim * 4
    path = write_model(tmp_path / "tr.toml", model_toml(v, "tr", ["test"]))
    prof = load_model(str(path))
    assert prof.build_ms_per_layer == 0.3 and prof.consumer_count == 0


def test_short_real_calibrate_gives_positive_numbers(tiny_random_converted, tmp_path,
                                                     model_copy):
    from calibration.calibrate import calibrate
    from engine.queue_depth import FILE

    model = model_copy(tiny_random_converted)  # calibrate writes its queue depth beside it
    cal = calibrate(model, tmp_path, quick=True)
    assert not list(tmp_path.glob(".ssdmoe-*"))  # scratch files removed
    record = json.loads((model / FILE).read_text())
    assert record["readers"] in (1, 2) and set(record["gbps_by_depth"]) == {"1", "2"}
    assert record["read_bytes"] == json.loads((model / "manifest.json").read_text())[
        "bundle_bytes"]
    c, st = cal.compute, cal.storage
    assert all(t > 0 for t in st.cold_ms + st.warm_ms)
    assert st.flush_bytes >= 64 << 20 and "MiB, twice the last-level cache" in \
        cal.hardware["memcpy_gbps"][1]
    assert st.cold_ms[-1] > st.warm_ms[-1]  # a cold 8 MiB read is slower than a warm one
    assert all(t > 0 for t in c.glu_ms.values()) and set(c.glu_ms) == {1, 4}
    # the compute thread's CPU in the SwiGLU and the non-expert step: measured, and one thread's
    # CPU is no more than the wall it ran in (medians of separate samples: some slack)
    assert set(c.glu_cpu_ms) == {1, 4} and all(
        0 < c.glu_cpu_ms[k] < 1.5 * c.glu_ms[k] for k in c.glu_ms)
    assert 0 < c.non_moe_cpu_ms < 1.5 * c.non_moe_ms
    # the kernel's rate measured again (validate --transfer's drift check): the same figure,
    # within this machine's noise
    rate = expert_kernel_gbps(model, reps=3, repeats=1)
    assert cal.hardware["expert_gbps"][0] / 3 < rate < cal.hardware["expert_gbps"][0] * 3
    assert c.build_ms_per_layer > 0 and c.non_moe_ms > 0 and c.step_ms > 0
    # the exact path per decode step (the scenario's starting figure), and timed alone (a note)
    assert c.path_build_ms_per_layer["exact"] > 0
    assert c.path_build_ms_per_layer["exact_alone"] == c.engine_build_ms_per_layer
    assert c.warm_bundle_ms > 0 and c.cold_bundle_ms > 0 and c.cold_bundles > 0
    # the cold reads' mean is over a sample of at least the size asked for (sampled steps,
    # the pages dropped again as often as it takes)
    from calibration.calibrate import QUICK_COMPUTE

    assert c.cold_bundles >= QUICK_COMPUTE["cold_reads"]
    assert c.handoff_reps == 200 and 0 < c.handoff_p10_ms <= c.handoff_ms
    assert cal.hardware["handoff_ms"][0] == pytest.approx(c.handoff_ms, abs=1e-4)
    assert 0 < c.reader_wake_p10_ms <= c.reader_wake_ms  # the round trip's first part
    assert cal.hardware["reader_wake_ms"][0] == pytest.approx(c.reader_wake_ms, abs=1e-4)
    # the GIL's hand-over: 50 per busy length, each stamped after its release (a loaded
    # machine can put the tail past the main thread's 2 ms nap: the waiter waits for a core)
    assert c.gil_handoff_reps == 100 and 0 < c.gil_handoff_ms <= c.gil_handoff_p90_ms
    assert cal.hardware["gil_handoff_ms"][0] == pytest.approx(c.gil_handoff_ms, abs=1e-4)
    # a cold read's thread CPU: part of its wall (the rest waits on the device), where the
    # expert files' pages could be dropped (else not measured, left out)
    if c.cold_read_reps:
        assert 0 < c.cold_read_cpu_ms <= c.cold_read_wall_ms * 1.05
        # with the per-page slope, the per-request part: the bundle's read less its pages
        per_page = cal.hardware.get("cold_read_cpu_us_per_page", (0.0, ""))[0]
        pages = c.cold_page_cpu[0][0] if per_page else 0
        assert cal.hardware["cold_read_cpu_ms"][0] == pytest.approx(
            max(c.cold_read_cpu_ms - pages * per_page / 1e3, 0.0), abs=2e-4)
        # the sizes that fit the layer files (not all of them on this small fixture), one
        # bundle's pages first; the longest read costs more CPU
        sizes = [n for n, _ in c.cold_page_cpu]
        assert len(sizes) >= 2 and sizes == [sizes[0] * span for span in PAGE_SPANS[:len(sizes)]]
        assert c.cold_page_cpu[-1][1] > c.cold_page_cpu[0][1] > 0
    else:
        assert "cold_read_cpu_ms" not in cal.hardware
    # the main thread's refused ask for a cold bundle (nan only when nothing could be dropped)
    assert ("refused_warm_ms" in cal.hardware) == (c.refused_warm_ms == c.refused_warm_ms)
    if "refused_warm_ms" in cal.hardware:
        assert 0 < c.refused_warm_ms < c.cold_bundle_ms
    # async_eval's bounded queue: what was left after it returned is part of a step's compute
    # (quick: 2 warm-up + 4 decode steps, a router per layer timed, prompts not)
    assert c.queue_ahead_reps == 6 * c.layers
    assert 0 <= c.queue_ahead_ms and 0 <= c.async_blocked_ms
    assert cal.hardware["queue_ahead_ms"][0] == pytest.approx(c.queue_ahead_ms, abs=1e-4)
    # the same after a layer's experts are handed over (a fill point's gather): every layer
    assert c.gather_queue_ahead_reps == 6 * c.layers and c.gather_queue_ahead_ms >= 0
    assert cal.hardware["gather_queue_ahead_ms"][0] == pytest.approx(c.gather_queue_ahead_ms,
                                                                     abs=1e-4)
    # the exact path's zeroed stack against the rotation (calibration.zero_fill_probe): the
    # rotations ascending, each a positive time per MiB, the profile's curve one rate each
    rotations = [mib for mib, _ in c.zero_fill_curve]
    assert rotations and rotations == sorted(rotations)
    assert all(ms > 0 for _, ms in c.zero_fill_curve)
    assert cal.hardware["zero_fill_rotation_mib"][0] == rotations
    assert len(cal.hardware["zero_fill_rotation_gbps"][0]) == len(rotations)
    # a decode step's MLX primitives (its graph, counted: more than a few per layer), and the
    # hand-over probe across cores where there are two (a difference: any sign when busy)
    assert c.primitives_per_step > 10 * c.layers
    assert cal.model["primitives_per_layer"][0] == pytest.approx(
        c.primitives_per_step / c.layers, abs=0.06)
    if handover_probe.can_measure():
        assert c.cross_core_primitives == handover_probe.PIECES * 5 * handover_probe.LINKS
        assert cal.hardware["cross_core_op_us"][0] >= 0
        assert cal.hardware["cross_core_op_main_us"][0] >= 0
        assert c.cross_core_op_cpu_us == c.cross_core_op_cpu_us  # kept in the raw figures
    else:
        assert "cross_core_op_us" not in cal.hardware
    # the compute thread's share of a compute wall, and the main thread's dispatch beside it
    assert 0 <= cal.model["compute_wait_ms_per_layer"][0] < c.step_ms / c.layers
    assert cal.model["dispatch_cpu_ms_per_layer"][0] == cal.model["fill_ms_per_layer"][0] > 0
    for key in ("ssd_bandwidth_gbps", "memcpy_gbps", "mem_bandwidth_gbps", "expert_gbps",
                "compute_tflops", "zero_fill_gbps", "page_drop_us_per_page"):
        assert cal.hardware[key][0] > 0, key
    path = write_hardware(tmp_path / "q.toml", hardware_toml(cal.hardware, "q", cal.when, "t"))
    assert load_hardware(str(path)).lazy_compute is True
    assert load_hardware(str(path)).queue_ahead_ms == cal.hardware["queue_ahead_ms"][0]


def test_the_gil_hand_over_probe_waits_in_a_cold_read_as_a_reader_does(tmp_path, monkeypatch):
    """calibration.compute_probes.gil_handoff_times: given an expert file, its waiter blocks in
    reads of that file's pages, each dropped from the page cache first (a reader's wait on the
    device), not in a timer nap; one hand-over per release, none negative."""
    import calibration.compute_probes as probes
    from engine import platform

    if not platform.current().can_drop_pages:
        pytest.skip("needs dropping pages (posix_fadvise)")
    path = tmp_path / "layer.safetensors"
    path.write_bytes(bytes(64 * 4096))
    reads, drops, naps = [], [], []
    real_pread, real_sleep = probes.os.pread, probes.time.sleep
    real_drop = platform.current().drop_pages

    def pread(fd: int, n: int, off: int) -> bytes:
        reads.append(off)
        return real_pread(fd, n, off)

    def drop_pages(fd: int, off: int = 0, n: int = 0) -> None:
        drops.append(off)
        real_drop(fd, off, n)

    def sleep(seconds: float) -> None:
        if seconds < 0.001:  # the waiter's nap (the main thread sleeps 2 ms)
            naps.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(probes.os, "pread", pread)
    monkeypatch.setattr(platform.current(), "drop_pages", drop_pages)
    monkeypatch.setattr(probes.time, "sleep", sleep)
    times = probes.gil_handoff_times(5, read_from=path)
    assert len(times) == 10 and min(times) >= 0.0
    assert reads and reads == drops  # every read was of a page dropped just before
    assert all(off % 4096 == 0 and off < 64 * 4096 for off in reads)
    assert naps == []  # the waiter never napped
    reads.clear()
    probes.gil_handoff_times(5)  # no file: it naps
    assert reads == [] and naps


def test_the_kernels_page_cache_policy_is_read_off_the_machine(tmp_path):
    """Linux without multi-generational LRU (no lru_gen file, or 0) keeps the active/inactive
    lists; with it on, or on macOS, the profile keeps a plain LRU and says why."""
    from calibration.machine import page_cache_policy

    gen = tmp_path / "enabled"
    assert page_cache_policy("Linux", gen)[0] == "linux-two-list"  # absent
    gen.write_text("0x0000\n")
    assert page_cache_policy("Linux", gen)[0] == "linux-two-list"
    gen.write_text("0x0007\n")
    policy, why = page_cache_policy("Linux", gen)
    assert policy == "lru" and "multi-generational" in why
    assert page_cache_policy("Darwin", gen)[0] == "lru"


def test_dropping_cached_pages_costs_per_page(tmp_path):
    """calibration.storage_probes.page_drop_times against the kernel: the ranges' pages are
    really dropped (mincore), so the 256-page drop costs several times the 4-page one (a drop that
    left the pages cached, as a drop of part of a large folio does, costs the same ~1 us). The
    ratio is ~9-12x on 2-core VMs, with a per-call floor that varies by machine: 5x keeps the
    broken case (~1-3x) out without failing on a slow machine's floor."""
    from calibration.storage_probes import DROP_PAGES, page_drop_times, write_scratch
    from engine.platform import ResidencyProbe, map_for_residency, unmap

    path = tmp_path / "scratch.bin"
    write_scratch(path, 16 << 20)
    few, many = page_drop_times(path, n=8)
    assert DROP_PAGES == (4, 256) and many > 5 * few > 0
    fd = os.open(path, os.O_RDONLY)
    addr = map_for_residency(fd, 16 << 20)
    try:
        resident, total = ResidencyProbe().resident_pages(addr, [(0, 16 << 20)])
        assert resident == 0 and total == 4096  # every range read was dropped again
    finally:
        unmap(addr, 16 << 20)
        os.close(fd)


def test_a_recalibration_keeps_both_routing_fits(tmp_path):
    """calibrate measures the machine, not the model's routing: the router's fit and the
    prerouter heads' (`sim profile-model --trace` of a --prerouter run) both survive a rewrite
    of the model profile, each with where it came from; measured keys are not carried."""
    from ssdmoe_cli.calibrate_cmd import KEPT, _kept_routing_fit

    path = tmp_path / "m.toml"
    path.write_text(
        "layers = 6  # manifest\n"
        "build_ms_per_layer = 0.2  # measured\n"
        "routing_k = [4]  # K=4: 376 token pairs of trace A\n"
        "routing_reuse = [0.14]  # kept from the earlier profile: trace A overlap\n"
        "prerouted_routing_k = [4]  # K=4: 376 token pairs of trace B\n"
        "prerouted_routing_skew = [0.76]  # Zipf exponent of trace B\n")
    kept = _kept_routing_fit(path)
    assert kept == {
        "routing_k": ([4], f"{KEPT} K=4: 376 token pairs of trace A"),
        "routing_reuse": ([0.14], f"{KEPT} trace A overlap"),  # not "kept ... kept ..."
        "prerouted_routing_k": ([4], f"{KEPT} K=4: 376 token pairs of trace B"),
        "prerouted_routing_skew": ([0.76], f"{KEPT} Zipf exponent of trace B"),
    }
    assert _kept_routing_fit(tmp_path / "absent.toml") == {}


def test_primitives_are_counted_from_the_graph():
    """calibration.handover_probe.primitives counts MLX's own graph (mx.export_to_dot): a link
    y = tanh(y * a + b) is five primitives, two broadcasts of the scalars, multiply, add and
    tanh; an evaluated input is not one."""
    import mlx.core as mx

    x = mx.ones((8,))
    mx.eval(x)
    assert handover_probe.primitives(mx.tanh(x * 2.0 + 1.0)) == 5
    assert handover_probe.primitives(handover_probe._chain(x, 3)) == 15


def test_the_hand_over_probe_needs_two_cores(monkeypatch):
    """On one core (or without sched_setaffinity) there is nothing to compare: None, and
    calibrate writes no cross_core_op_us (the sim then charges nothing)."""
    monkeypatch.setattr(handover_probe.os, "sched_getaffinity", lambda _pid: {0})
    assert handover_probe.measure(rounds=1, steps=5) is None


def test_the_scenario_starts_the_exact_path_from_its_decode_step(tmp_path):
    """calibrate's scenario starts the exact path's in-decode figure from its per-step cost in
    the decode loop (each stack evaluated after a router sync, as in decode), not from the same
    work timed alone, which is kept as a text note: on both machines of reports/cross-machine
    the alone figure was about half the in-decode fit."""
    import tomllib
    from types import SimpleNamespace

    from profile_helpers import MACHINE, compute, storage

    from calibration.profile_values import hardware_values
    from ssdmoe_cli.calibrate_cmd import _write_scenario

    c = compute(path_build_ms_per_layer={"exact": 0.42, "exact_alone": 0.16, "hot": 0.2})
    cal = SimpleNamespace(compute=c, storage=storage(), when="now",
                          hardware=hardware_values(storage(), c, MACHINE, active_params=1e6))
    path = _write_scenario(tmp_path / "s.toml", "this-machine", "tiny-trained", cal, "cmd")
    data = tomllib.loads(path.read_text())
    assert data["in_decode"]["build_ms_per_layer.exact"] == 0.42
    assert data["in_decode"]["build_ms_per_layer.hot"] == 0.2
    assert data["model_overrides"]["build_ms_per_layer"] == 0.42
    assert data["notes"]["build_ms_per_layer.exact_alone"] == "0.1600"


def _cache_index(root, name: str, level: int, size: str, kind: str) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "level").write_text(f"{level}\n")
    (d / "size").write_text(f"{size}\n")
    (d / "type").write_text(f"{kind}\n")


def test_the_last_level_cache_is_read_off_sysfs(tmp_path):
    """The highest data or unified level's size, by hand: 48K L1d, 32K L1i, 2048K L2, 480M L3
    -> 480 MiB; an instruction cache never counts; nothing reported -> None. On this machine,
    against glibc's own reading (sysconf, from cpuid) where it reports an L3."""
    from calibration.machine import last_level_cache_bytes

    caches = tmp_path / "cache"
    _cache_index(caches, "index0", 1, "48K", "Data")
    _cache_index(caches, "index1", 1, "32K", "Instruction")
    _cache_index(caches, "index2", 2, "2048K", "Unified")
    assert last_level_cache_bytes(caches, "Linux") == 2048 << 10
    _cache_index(caches, "index3", 3, "480M", "Unified")
    assert last_level_cache_bytes(caches, "Linux") == 480 << 20
    _cache_index(caches, "index4", 4, "64M", "Instruction")
    assert last_level_cache_bytes(caches, "Linux") == 480 << 20
    assert last_level_cache_bytes(tmp_path / "none", "Linux") is None
    try:
        glibc_l3 = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError):
        glibc_l3 = 0
    if glibc_l3 > 0:
        assert last_level_cache_bytes() == glibc_l3


def test_the_cache_flush_is_twice_the_last_level_cache():
    """Twice the LLC (a 480 MiB L3 -> 960 MiB), never below 64 MiB (nothing reported), never
    above an eighth of the RAM."""
    from calibration.storage_probes import MIN_CACHE_FLUSH_BYTES, cache_flush_bytes

    assert cache_flush_bytes(480 << 20, 24 << 30) == 960 << 20
    assert cache_flush_bytes(None, 24 << 30) == MIN_CACHE_FLUSH_BYTES == 64 << 20
    assert cache_flush_bytes(8 << 20, 24 << 30) == 64 << 20
    assert cache_flush_bytes(4 << 30, 16 << 30) == 2 << 30


class _ScriptedClock:
    """perf_counter for storage_probes: each timed read (a pair of calls) lasts the next of
    `ms`, in order."""

    def __init__(self, ms: list[float]) -> None:
        self.ms, self.t, self.calls = list(ms), 0.0, 0

    def perf_counter(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:
            self.t += self.ms.pop(0) / 1e3
        return self.t


def test_buffered_reads_charge_the_mean_after_flushing_the_cpu_caches(tmp_path, monkeypatch):
    """A read's cost is the mean of its repeats (one slow read of four lifts it: 1, 1, 1, 9 ms
    -> 3 ms, where the 10th percentile says 1), and the warm reads come after writing twice
    the last-level cache (a machine reporting 40 MiB -> 80 MiB written)."""
    import calibration.storage_probes as probes

    path = tmp_path / "scratch.bin"
    probes.write_scratch(path, 8 << 20)
    flushed: list[int] = []
    monkeypatch.setattr(probes, "last_level_cache_bytes", lambda: 40 << 20)
    monkeypatch.setattr(probes, "flush_cpu_caches", lambda scratch: flushed.append(scratch.nbytes))
    monkeypatch.setattr(probes, "time", _ScriptedClock([1, 1, 1, 9, 2, 2, 2, 6]))
    cold, warm = probes.buffered_reads(path, (64 << 10,), per_size=4, rounds=1)
    assert cold == [pytest.approx(3.0)] and warm == [pytest.approx(3.0)]
    assert flushed == [80 << 20]


def test_macos_reports_its_cache_through_sysctl(monkeypatch):
    """macOS: the L3 where sysctl has one (Intel Macs), else the performance cores' L2 (Apple
    silicon reports no system-level cache), else the plain L2; None when sysctl has none."""
    import subprocess

    from calibration.machine import last_level_cache_bytes

    answers = {"hw.perflevel0.l2cachesize": "16777216", "hw.l2cachesize": "4194304"}

    def sysctl(cmd, **_):
        key = cmd[-1]
        if key not in answers:
            raise subprocess.CalledProcessError(1, cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=answers[key] + "\n")

    monkeypatch.setattr(subprocess, "run", sysctl)
    assert last_level_cache_bytes(system="Darwin") == 16 << 20
    answers["hw.l3cachesize"] = "12582912"
    assert last_level_cache_bytes(system="Darwin") == 12 << 20
    answers.clear()
    assert last_level_cache_bytes(system="Darwin") is None


def _other_threads_cpu_s() -> float:
    """CPU seconds of every thread of this process but the main one, from /proc (ticks)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for task in Path("/proc/self/task").iterdir():
        if int(task.name) == threading.main_thread().native_id:
            continue
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_the_compute_threads_share_is_its_cpu_over_the_wall(tiny_random_converted):
    """Runner.step's compute-thread CPU (the process's CPU less the main thread's, over the
    final eval) against the kernel's own per-thread accounting (/proc/self/task/*/stat) of every
    other thread over the same steps: the resident path evaluates lazily, so the compute
    thread runs inside those evals only."""
    from calibration.compute_probes import ResidentPath, Runner

    stacks: dict = {}
    runner = Runner(tiny_random_converted,
                    path_factory=lambda s, i: ResidentPath(s, i, False, stacks))
    try:
        for _ in range(10):
            runner.step(record=False)
        walls: list[float] = []
        before = _other_threads_cpu_s()
        start = time.perf_counter()
        while time.perf_counter() - start < 3.0:  # long against the kernel's 10 ms ticks
            t0 = time.perf_counter()
            runner.step()
            walls.append(time.perf_counter() - t0)
        other = _other_threads_cpu_s() - before
        cpus, evals = runner.times.compute_cpu_ms, runner.times.eval_ms
    finally:
        runner.close()
    shares = [c / e for c, e in zip(cpus, evals, strict=True)]
    assert 0 < max(shares) <= 1.2
    assert sum(cpus) / 1e3 == pytest.approx(other, rel=0.15, abs=0.03)
