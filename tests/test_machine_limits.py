"""Emulated machines (engine.machine_limits): each limit does what it says, checked against the
kernel itself in a child process (so this one is never moved), and is removed on exit, error and
Ctrl-C. A memory limit keeps the files' resident pages (counted by util-linux's fincore, i.e.
the kernel's mincore) within the limit less the process's own memory; --cpus 1 puts every
thread of the running engine on that core (the kernel's affinity and last CPU of each thread);
a quota F gives a spinning thread F of a core (its CPU time over wall time). What cannot be
set is one line. The kernel tests need root and the controllers (this project's machines and
CI have both); elsewhere they skip, saying why."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from contract.errors import BadInput
from engine.cgroups import CgroupUnavailable, ProcessGroups
from engine.machine_limits import (
    MIB,
    EmulatedMachine,
    MachineLimits,
    available_cpus,
    check_available,
    parse_size,
)
from engine.throttle import ThrottleSpec

REPO = Path(__file__).resolve().parents[1]


def _why_not(limits: MachineLimits) -> str | None:
    try:
        check_available(limits)
    except CgroupUnavailable as err:
        return str(err)
    return None


def needs(**kw):
    why = _why_not(MachineLimits(**kw))
    return pytest.mark.skipif(why is not None, reason=f"cannot emulate here: {why}")


def _child(code: str, timeout: float = 120) -> dict:
    """Run `code` in a fresh interpreter at the repository root; it prints one JSON line."""
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _our_groups() -> set[Path]:
    return set(Path("/sys/fs/cgroup").rglob("ssdmoe-*"))


# ------------------------------------------------------------------ memory


@needs(mem_limit=1 << 30)
@pytest.mark.skipif(shutil.which("fincore") is None, reason="util-linux fincore not installed")
@pytest.mark.parametrize("limit_mib", [48, 96])
def test_memory_limit_keeps_file_pages_within_it(tmp_path, limit_mib):
    """A 256 MiB file read whole under a limit of own + LIMIT: the kernel keeps at most the
    group's limit of it resident, and (the control) all of it without the limit."""
    (tmp_path / "experts").mkdir()
    f = tmp_path / "experts" / "layer_000.safetensors"
    with open(f, "wb") as fh:
        for _ in range(256):
            fh.write(os.urandom(MIB))
        os.fsync(fh.fileno())
    out = _child(f"""
        import json, subprocess
        from pathlib import Path
        from engine.machine_limits import EmulatedMachine, MachineLimits, anonymous_bytes
        def read_all(path):
            with open(path, "rb", buffering=0) as fh:
                while fh.read(1 << 20):
                    pass
        def resident(path):
            return int(subprocess.run(["fincore", "-b", "-n", "-o", "RES", path],
                                      capture_output=True, text=True, check=True).stdout)
        f = "{f}"
        limit = anonymous_bytes() + {limit_mib} * 2**20
        with EmulatedMachine(Path("{tmp_path}"), MachineLimits(mem_limit=limit)) as m:
            assert resident(f) == 0, "entering did not drop the model's pages"
            read_all(f)
            inside = resident(f)
            group = m.record()["memory"]["group_limit_bytes"]
        read_all(f)
        print(json.dumps({{"inside": inside, "group": group, "outside": resident(f)}}))
    """)
    assert out["inside"] <= out["group"], out
    assert out["inside"] >= 0.5 * out["group"], out  # the limit is not far tighter than set
    assert out["group"] <= limit_mib * MIB + 16 * MIB  # own memory was taken off the limit
    assert out["outside"] >= 250 * MIB, out  # the control: unlimited, the file stays cached


# ------------------------------------------------------------------ cores


@needs(cpus=1)
def test_one_core_runs_every_engine_thread_on_it(tiny_random_converted):
    """The real engine (staged, 4 readers) generating under --cpus 1: every thread of the
    process may run only on that core and last ran on it. (The engine is imported inside, so
    the threads its imports start are the engine's too.)"""
    out = _child(f"""
        import json, os
        from pathlib import Path
        from engine.machine_limits import EmulatedMachine, MachineLimits
        model = Path("{tiny_random_converted}")
        with EmulatedMachine(model, MachineLimits(cpus=1)) as m:
            from engine.capture import capture, load_engine
            engine = load_engine(model, preset="staged", lead="layer", readers=4,
                                 page_cache_fraction=0.25)
            capture(engine, ["the quick brown fox"], 8, temp=1.0, seed=0)
            threads = {{}}
            for tid in os.listdir("/proc/self/task"):
                stat = Path(f"/proc/self/task/{{tid}}/stat").read_text()
                last_cpu = int(stat.rsplit(")", 1)[1].split()[36])
                threads[tid] = [sorted(os.sched_getaffinity(int(tid))), last_cpu]
            cores = m.record()["cpuset"]["cores"]
            engine.close()
        print(json.dumps({{"cores": cores, "threads": threads}}))
    """, timeout=300)
    assert len(out["cores"]) == 1
    core = out["cores"][0]
    assert len(out["threads"]) >= 5, out  # main + 4 readers at least
    for tid, (affinity, last_cpu) in out["threads"].items():
        assert affinity == [core], (tid, affinity)
        assert last_cpu == core, (tid, last_cpu)


@needs(cpu_quota=0.5)
@pytest.mark.parametrize("quota", [0.5, 0.25])
def test_quota_gives_a_spinning_thread_that_share(tmp_path, quota):
    out = _child(f"""
        import json, time
        from pathlib import Path
        from engine.machine_limits import EmulatedMachine, MachineLimits
        with EmulatedMachine(Path("{tmp_path}"), MachineLimits(cpu_quota={quota})):
            t0, c0 = time.perf_counter(), time.thread_time()
            while time.perf_counter() - t0 < 2.0:
                pass
            share = (time.thread_time() - c0) / (time.perf_counter() - t0)
        t0, c0 = time.perf_counter(), time.thread_time()
        while time.perf_counter() - t0 < 0.5:
            pass
        free = (time.thread_time() - c0) / (time.perf_counter() - t0)
        print(json.dumps({{"share": share, "free": free}}))
    """)
    assert abs(out["share"] - quota) <= 0.1 * quota, out
    assert out["free"] > 0.8, out  # the control: the quota is gone on leaving


# ------------------------------------------------------------------ removal


@needs(cpus=1, cpu_quota=1.0, mem_limit=1 << 30)
def test_removed_on_exit_error_and_interrupt(tmp_path):
    before = _our_groups()
    home = Path("/proc/self/cgroup").read_text()
    limits = MachineLimits(cpus=1, cpu_quota=1.0, mem_limit=1 << 30)
    with EmulatedMachine(tmp_path, limits) as m:
        assert len(_our_groups() - before) == 3, "one group per v1 hierarchy expected"
        assert m.record()["cpu_quota"]["cores"] == 1.0
    assert _our_groups() == before
    assert Path("/proc/self/cgroup").read_text() == home
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with EmulatedMachine(tmp_path, limits):
                assert _our_groups() - before
                raise exc
        assert _our_groups() == before, "a group left behind"
        assert Path("/proc/self/cgroup").read_text() == home
    assert set(os.sched_getaffinity(0)) == set(available_cpus())


def test_refused_setting_leaves_nothing(tmp_path):
    """A value the kernel refuses: one line naming the file, and no group left behind."""
    root = tmp_path / "cg"
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text("")
    bad = root / "memory" / "ssdmoe-bad"
    groups = ProcessGroups({"memory": [("memory.limit_in_bytes/x", "1")]}, root=root,
                           what="--mem-limit")
    with pytest.raises(CgroupUnavailable, match="--mem-limit: the kernel refused"):
        groups.__enter__()
    assert not bad.exists() and not list((root / "memory").glob("ssdmoe-*"))


# ------------------------------------------------------------------ what is written


def _fake_tree(tmp_path: Path, version: str) -> Path:
    root = tmp_path / "cg"
    if version == "v1":
        for name, probe in (("memory", "memory.limit_in_bytes"), ("cpuset", "cpuset.cpus"),
                            ("cpu", "cpu.cfs_quota_us"),
                            ("blkio", "blkio.throttle.read_bps_device")):
            (root / name).mkdir(parents=True)
            (root / name / probe).write_text("")
        (root / "cpuset" / "cpuset.mems").write_text("0\n")
    else:
        root.mkdir()
        (root / "cgroup.subtree_control").write_text("cpuset cpu io memory pids\n")
    return root


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_files_written_in_each_hierarchy(tmp_path, version, monkeypatch):
    """The files and values each hierarchy takes (v2 is not this machine's: a fake tree)."""
    import engine.machine_limits as ml

    monkeypatch.setattr(ml, "anonymous_bytes", lambda: 100 * MIB)
    root = _fake_tree(tmp_path, version)
    limits = MachineLimits(mem_limit=300 * MIB, cpus=1, cpu_quota=0.5,
                           throttle=ThrottleSpec(read_mbps=40))
    m = EmulatedMachine(REPO, limits, root=root)
    s = m.settings()
    dev = m.device
    first = str(available_cpus()[0])
    if version == "v1":
        assert s == {"memory": [("memory.limit_in_bytes", str(200 * MIB))],
                     "cpuset": [("cpuset.mems", "0"), ("cpuset.cpus", first)],
                     "cpu": [("cpu.cfs_period_us", "100000"), ("cpu.cfs_quota_us", "50000")],
                     "io": [("blkio.throttle.read_bps_device", f"{dev} 40000000")]}
    else:
        assert s == {"memory": [("memory.max", str(200 * MIB))],
                     "cpuset": [("cpuset.cpus", first)],
                     "cpu": [("cpu.max", "50000 100000")],
                     "io": [("io.max", f"{dev} rbps=40000000")]}


# ------------------------------------------------------------------ bad input


def test_parse_size():
    assert parse_size("700M") == 700 * MIB
    assert parse_size("1.5G") == 1536 * MIB
    assert parse_size("4096") == 4096
    assert parse_size("64 MiB") == 64 * MIB
    for bad in ("", "abc", "12X", "-5M", "0"):
        with pytest.raises(BadInput, match="--mem-limit"):
            parse_size(bad)


def test_bad_limits_are_one_line():
    have = len(available_cpus())
    with pytest.raises(BadInput, match=f"this machine has {have} core"):
        MachineLimits(cpus=have + 1)
    with pytest.raises(BadInput, match="--cpus 0"):
        MachineLimits(cpus=0)
    for q in (0, -1, have + 0.5):
        with pytest.raises(BadInput, match="--cpu-quota"):
            MachineLimits(cpu_quota=q)
    with pytest.raises(BadInput, match="at most the 1 core it runs on"):
        MachineLimits(cpus=1, cpu_quota=1.5)
    with pytest.raises(BadInput, match="not a number"):
        MachineLimits.parse(cpu_quota="half")


def test_below_own_memory_says_what_it_needs(tmp_path, monkeypatch):
    import engine.machine_limits as ml

    monkeypatch.setattr(ml, "anonymous_bytes", lambda: 300 * MIB)
    root = _fake_tree(tmp_path, "v1")
    m = EmulatedMachine(REPO, MachineLimits(mem_limit=200 * MIB), to_load=50 * MIB, root=root)
    with pytest.raises(BadInput) as err:
        m.settings()
    line = str(err.value)
    assert "300 MiB of its own memory" in line and "50 MiB" in line
    assert "give at least 354 MiB" in line and "\n" not in line


def test_not_root_and_not_linux_and_no_controller(monkeypatch, tmp_path):
    import engine.cgroups as cg

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(CgroupUnavailable, match="--cpus.*needs root"):
        check_available(MachineLimits(cpus=1))
    monkeypatch.setattr(cg.sys, "platform", "darwin")
    with pytest.raises(CgroupUnavailable, match="darwin has no control groups"):
        check_available(MachineLimits(mem_limit=1 << 30))
    monkeypatch.undo()
    with pytest.raises(CgroupUnavailable, match="no cgroup v1 cpu hierarchy"):
        cg.check_controllers(["cpu"], "--cpu-quota", root=tmp_path)


def test_cli_bad_limits_are_one_line(ssdmoe, tiny_random_converted, tmp_path):
    out = tmp_path / "t"
    out.mkdir()
    (out / "keep").write_text("an earlier trace")
    have = len(available_cpus())
    for flags, msg in ((["--cpus", str(have + 1)], "core"),
                       (["--cpu-quota", "0"], "--cpu-quota"),
                       (["--mem-limit", "lots"], "not a size"),
                       (["--mem-limit", "1M"], "below what this process needs")):
        r = ssdmoe("capture", str(tiny_random_converted), "--out", str(out), "--force",
                   *flags)
        if "needs root" in r.stderr or "no control groups" in r.stderr:
            continue
        assert r.returncode == 2 and msg in r.stderr, (flags, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert (out / "keep").read_text() == "an earlier trace"  # nothing lost


def test_bench_and_validate_refuse_bad_limits_in_one_line(ssdmoe, tiny_random_converted):
    have = len(available_cpus())
    for cmd in (["bench", str(tiny_random_converted), "--arms", "on-demand"],
                ["validate", str(tiny_random_converted), "--no-calibrate"]):
        for flags, msg in ((["--cpus", str(have + 1)], f"this machine has {have} core"),
                           (["--cpu-quota", "-1"], "--cpu-quota"),
                           (["--mem-limit", "12X"], "not a size")):
            r = ssdmoe(*cmd, *flags)
            assert r.returncode == 2 and msg in r.stderr, (cmd, flags, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@needs(mem_limit=1 << 30)
def test_bench_under_a_memory_limit(ssdmoe, tiny_random_converted, tmp_path):
    """A streaming arm below its resident weights is refused in one line; mlx-lm resident is
    let run into the limit and reported killed (what the kernel did to it), the run goes on."""
    r = ssdmoe("bench", str(tiny_random_converted), "--arms", "on-demand", "--rounds", "1",
               "--max-tokens", "2", "--mem-limit", "1M", "--json", str(tmp_path / "a.json"))
    assert r.returncode == 2 and "below what this process needs" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    out = tmp_path / "b.json"
    r = ssdmoe("bench", str(tiny_random_converted), "--arms", "resident", "--rounds", "1",
               "--max-tokens", "2", "--mem-limit", "24M", "--json", str(out))
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["summary"]["resident"]["killed_rounds"] == 1
    assert "out of memory" in result["summary"]["resident"]["killed"]
    assert result["machine_limits"]["mem_limit"] == 24 << 20
    assert "killed: out of memory" in r.stdout
