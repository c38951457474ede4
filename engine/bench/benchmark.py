"""`ssdmoe bench`: every arm on the same prompts in one invocation, each arm in its own process,
arm order rotated per round, warm-up excluded, medians over rounds.

Arms:
  resident         plain mlx-lm: the model fully loaded, `mlx_lm.generate_step` (its one-step
                   async lookahead included): the honest baseline
  engine-resident  the same resident model through engine.generate (the same lookahead, plus
                   per-step timing and hooks): the loop's own cost
  resident-sync    engine-resident plus one host sync of each MoE layer's router output while
                   the graph is built, no loads: what knowing the routing only when it happens
                   costs when nothing hides it (the exact and hot paths pay it; no lookahead
                   is possible past such a sync)
  on-demand        streaming, exact path everywhere (preset on-demand)
  hot              whole-layer prefill + hot LRU decode (preset hot)
  staged           whole-layer prefill + staged decode filled on demand (preset staged): the
                   router's ids come to the host at fill points during evaluation, while the
                   next step's graph is built (engine.fill_points)
  staged-oracle    staged decode filled one token ahead from routing recorded in an untimed
                   identical run: what a perfect prerouter would give (an upper bound)
  staged-layer     staged decode with the same-token lead (engine.layer_lead): layer N+1's
                   set is the next router on layer N's state, read while layer N computes; it
                   IS the routing, so tokens differ from resident's as with the heads
  staged-prerouter staged decode with trained prerouter heads (MODEL/prerouter, or
                   --prerouter DIR; `ssdmoe train heads`): their predictions ARE the routing
                   of the consumer layers, staged one token ahead; layers without a head fill
                   on demand. A different model in effect: its tokens differ from resident's
  staged-prerouter-hint  staged-prerouter plus the first-layer hint (engine.first_layer_hint:
                   the first MoE layer's likely experts read from each token, before its
                   router; the table `train heads` fits): the same tokens as staged-prerouter
  staged-prerouter-lora  staged-prerouter plus the recovery LoRA (--lora DIR, default the
                   adapter trained for those heads, MODEL/lora/k{K}-distill or -sft), unmerged:
                   what the adapter costs at decode (paired with staged-prerouter) and to load
                   (`lora_load_s`)

Per arm: decode and prefill tok/s, MLX peak and process peak RSS (reset after warm-up),
blocked ms per decode step (main thread waiting on expert loads), loads and cold MiB per
decode step, app-cache hits/misses, ratio to `resident`, and the bound
max(compute time, cold bytes / disk bandwidth) per decode step, where compute time is the
resident arm's step time and disk bandwidth is measured in the same run (O_DIRECT sequential
reads of the expert files, which do not touch the page cache).

Decode tokens are sampled (temperature 1, seed 0 by default, the same in every arm) so that
routing is realistic; greedy decoding of the tiny fixtures loops and every cache hits
(`--temp 0` restores it). With `--read-mbps` / `--read-iops` each arm's worker runs under the
kernel's block-I/O read throttle (engine.throttle), and the bound's bandwidth is the throttle's
rate where that is lower than the disk's.

`--before DIR` runs every streaming arm again on the same model converted otherwise,
`--before-code DIR` from another checkout of this project (an earlier engine, e.g. `git
worktree add DIR COMMIT`), and `--before-native-reads/--before-python-reads` with the other
kind of reader threads, as ARM@before, in the same rounds: both sides of a change measured
in one run and paired round by round.

Warm: the parent reads every expert file before each streaming arm (page cache warm).
With a page-cache budget: the streaming arm's store drops the expert files' pages when it
opens and keeps them within the budget; after warm-up it drops them again, so every arm's
timed run starts from the same (cold) state."""

from __future__ import annotations

import json
import mmap
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.child_env import importing
from traces.regime import DECODE_SEED, DECODE_TEMP, decode_routing

ARMS = ("resident", "engine-resident", "resident-sync", "on-demand", "hot", "staged",
        "staged-oracle", "staged-layer", "staged-prerouter", "staged-prerouter-hint",
        "staged-prerouter-lora")
# route by prediction: their own tokens
PREDICTED = ("staged-layer", "staged-prerouter", "staged-prerouter-hint",
             "staged-prerouter-lora")
DEFAULT_ARMS = ("resident", "on-demand", "hot", "staged")
STREAMING = {"on-demand": "on-demand", "hot": "hot", "staged": "staged",
             "staged-oracle": "staged", "staged-layer": "staged", "staged-prerouter": "staged",
             "staged-prerouter-hint": "staged", "staged-prerouter-lora": "staged"}
PROMPTS = Path(__file__).resolve().parents[2] / "traces" / "prompts" / "default.jsonl"
# suffix of an arm run on BenchSpec.before (the same model converted otherwise) and/or by
# BenchSpec.before_code (another checkout's engine)
BEFORE = "@before"


def base_arm(arm: str) -> str:
    return arm.removesuffix(BEFORE)


def all_arms(spec: BenchSpec) -> list[str]:
    """The arms a run times: the given ones, then with `before`, `before_code` or
    `before_native_reads` each streaming one again on that model, with that engine or with
    those reader threads."""
    extra = [a + BEFORE for a in spec.arms if a in STREAMING] \
        if spec.before or spec.before_code or spec.before_native_reads is not None else []
    return list(spec.arms) + extra


@dataclass
class BenchSpec:
    model: str
    arms: list[str] = field(default_factory=lambda: list(DEFAULT_ARMS))
    prompts: list[str] = field(default_factory=list)
    max_tokens: int = 64
    rounds: int = 3
    page_cache_budget: int | None = None
    prerouter: str | None = None  # heads for staged-prerouter (default MODEL/prerouter)
    lora: str | None = None  # adapter of staged-prerouter-lora
    warmup_tokens: int = 8
    timeout_s: int = 900
    temp: float = DECODE_TEMP  # sampled decoding: realistic routing (0 = greedy)
    seed: int = DECODE_SEED
    read_mbps: float | None = None  # block-I/O read throttle of each arm's worker
    read_iops: int | None = None
    # the emulated machine each worker runs in (engine.machine_limits.MachineLimits.to_dict)
    mem_limit: int | None = None
    cpus: int | None = None
    cpu_quota: float | None = None
    readers: int | None = None  # reads in flight (None: the model's queue_depth.json)
    native_reads: bool = False  # queued bundle reads on native threads (engine.native_reads)
    cache_policy: str | None = None  # every cached arm's eviction policy (None: lru)
    # the same model converted otherwise (e.g. `convert --layout stacked`): every streaming
    # arm also runs on it, as ARM@before, in the same rounds, and is paired with ARM
    before: str | None = None
    # another checkout of this project: ARM@before runs its engine (with `before`, on that model)
    before_code: str | None = None
    # ARM@before's reader threads (None: native_reads); set, it makes the @before arms alone
    before_native_reads: bool | None = None


# ---------------------------------------------------------------- helpers (no MLX)


def expert_files(model: Path) -> list[Path]:
    from engine.manifest import read_manifest

    m = read_manifest(model)
    return [m.path(m.layers[i].file) for i in m.moe_layers]


def expert_bytes(model: Path) -> int:
    from engine.manifest import read_manifest

    m = read_manifest(model)
    return m.bundle_bytes * m.num_experts * len(m.layers)


def disk_bandwidth(files: list[Path], min_bytes: int = 256 << 20, min_s: float = 1.0,
                   block: int = 4 << 20) -> float:
    """Bytes/s of O_DIRECT sequential reads of `files` (cycled until both `min_bytes` and
    `min_s` are reached, at most 1 GiB): the disk, not the page cache (O_DIRECT never hits it).
    Where O_DIRECT is refused, buffered reads after dropping each file's pages (engine.platform:
    F_NOCACHE on macOS)."""
    from engine import platform

    plat = platform.current()
    buf = mmap.mmap(-1, block)  # page aligned, as O_DIRECT needs
    total, t0 = 0, time.perf_counter()
    while total < min(min_bytes, 1 << 30) or (time.perf_counter() - t0 < min_s
                                              and total < 1 << 30):
        for f in files:
            try:
                fd = plat.open_uncached(str(f))
            except OSError:
                fd = plat.open_buffered(str(f))
                if plat.can_drop_pages:
                    plat.drop_pages(fd)
            try:
                off = 0
                while (n := os.preadv(fd, [buf], off)) > 0:
                    off += n
                    total += n
            finally:
                os.close(fd)
    return total / max(time.perf_counter() - t0, 1e-9)


def warm_files(files: list[Path]) -> None:
    """Read every file once, buffered: its pages end up in the page cache."""
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(8 << 20):
                pass


def parse_bytes(text: str, expert_total: int) -> int:
    """'123', '64M', '1.5G', '256MiB' or 'N%' (of the model's expert bytes)."""
    from contract.errors import BadInput

    t = text.strip()
    try:
        if t.endswith("%"):
            return int(expert_total * float(t[:-1]) / 100)
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        t = t.removesuffix("iB").removesuffix("B")
        if t and t[-1].upper() in units:
            return int(float(t[:-1]) * units[t[-1].upper()])
        return int(t)
    except ValueError:
        raise BadInput(f"--page-cache-budget {text!r}: not a size (bytes, 64M, 1G or 25%)") \
            from None


def load_prompts(path: Path, n: int) -> list[str]:
    from contract.errors import BadInput

    if not path.is_file():
        raise BadInput(f"{path}: missing (prompts file, one JSON object with 'prompt' a line)")
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(str(json.loads(line)["prompt"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise BadInput(f"{path}: line {i}: expected {{\"prompt\": ...}}") from None
    if not out:
        raise BadInput(f"{path}: no prompts")
    return out[:n]


# ---------------------------------------------------------------- worker (one arm, own process)


# ---------------------------------------------------------------- parent


def summarize_arm(runs: list[dict]) -> dict:
    """Medians over rounds of the per-round totals (of the rounds whose worker was not killed;
    `killed_rounds` counts those, and their decode_tok_s_rounds entry is 0)."""
    def per_round(r: dict) -> dict:
        ps = r["prompts"]
        steps = sum(p["decode_steps"] for p in ps)
        loads = sum(p.get("decode_loads", 0) for p in ps)
        cold = sum(p.get("decode_cold_loads", 0) for p in ps)
        syscalls = [p.get("decode_read_syscalls", -1) for p in ps]
        device = [p.get("decode_device_reads", -1) for p in ps]
        cold_ms = [t for p in ps for t in p.get("cold_load_ms", [])]
        covered_ms = sum(p.get("cold_reading_ns", 0) for p in ps) / 1e6
        dec_s = sum(p["decode_s"] for p in ps)
        return {
            "decode_tok_s": steps / dec_s if dec_s > 0 else 0.0,
            "prefill_tok_s": sum(p["prompt_tokens"] for p in ps) / sum(p["prefill_s"] for p in ps),
            "step_ms": 1e3 * dec_s / max(steps, 1),
            "cpu_ms_per_step": 1e3 * sum(p.get("decode_cpu_s", 0) for p in ps) / max(steps, 1),
            "loadavg_1m": r.get("loadavg", [0])[0],
            "blocked_ms_per_step": sum(p["decode_blocked_ns"] for p in ps) / 1e6 / max(steps, 1),
            "loads_per_step": sum(p["decode_loads"] for p in ps) / max(steps, 1),
            "cold_mib_per_step": sum(p["decode_cold_bytes"] for p in ps) / 2**20 / max(steps, 1),
            "mib_per_step": sum(p["decode_bytes"] for p in ps) / 2**20 / max(steps, 1),
            "peak_mlx_bytes": r["peak_mlx_bytes"], "peak_rss_bytes": r["peak_rss_bytes"],
            "cache_hits": r["stats"].get("cache_hits", 0),
            "cache_misses": r["stats"].get("cache_misses", 0),
            # the kernel's counts over decode: read system calls per load (every thread of
            # the process), the device's completed reads per cold load (every process's)
            "read_syscalls_per_load": sum(syscalls) / loads
            if loads and min(syscalls, default=-1) >= 0 else float("nan"),
            "device_reads_per_cold_load": sum(device) / cold
            if cold and min(device, default=-1) >= 0 else float("nan"),
            "cold_load_ms": statistics.median(cold_ms) if cold_ms else float("nan"),
            # the time some cold read was in flight, per cold load (engine.bench.arm), and how
            # many were in flight on average while any was
            "cold_load_covered_ms": covered_ms / cold if cold and covered_ms else float("nan"),
            "cold_reads_in_flight": sum(cold_ms) / covered_ms if covered_ms else float("nan"),
        }
    live = [r for r in runs if not r.get("killed")]
    killed = {"killed_rounds": len(runs) - len(live),
              "killed": next((r["killed"] for r in runs if r.get("killed")), None)}
    per = [None if r.get("killed") else per_round(r) for r in runs]
    rounds = [0.0 if row is None else row["decode_tok_s"] for row in per]
    if not live:
        return {**killed, "decode_tok_s": 0.0, "decode_tok_s_rounds": rounds}
    rows = [row for row in per if row is not None]
    out = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    out["decode_tok_s_rounds"] = rounds
    out["buffer_bytes"] = live[0]["buffer_bytes"]
    if live[0].get("lora_load_s") is not None:
        out["lora_load_s"] = statistics.median(r["lora_load_s"] for r in live)
        out["lora_bytes"] = live[0]["lora_bytes"]
    return {**out, **killed}


def add_before_ratios(summary: dict[str, dict]) -> None:
    """ARM over ARM@before, paired within rounds (both ran in the same round), then the
    median: what the conversion changed, with the machine's drift cancelled."""
    for arm, s in summary.items():
        b = summary.get(arm + BEFORE)
        pairs = [] if b is None else [
            x / y for x, y in zip(s["decode_tok_s_rounds"], b["decode_tok_s_rounds"],
                                  strict=True) if y > 0]
        if pairs:
            s["over_before_paired"] = statistics.median(pairs)


def add_bounds(summary: dict[str, dict], bandwidth: float) -> None:
    """ratio to resident, and the bound max(compute, cold bytes / bandwidth) per step."""
    base = summary.get("resident")
    if base is not None and "step_ms" not in base:
        base = None  # resident was killed in every round: nothing to compare with
    compute_ms = base["step_ms"] if base else None
    for s in summary.values():
        if "step_ms" not in s:
            continue  # killed in every round
        s["ratio_to_resident"] = s["decode_tok_s"] / base["decode_tok_s"] if base else None
        # paired: arm / resident within each round (run minutes apart), then the median;
        # steadier than the ratio of medians when the machine's load drifts
        pairs = [a / b for a, b in zip(s["decode_tok_s_rounds"], base["decode_tok_s_rounds"],
                                       strict=True) if b > 0] if base else []
        s["ratio_paired"] = statistics.median(pairs) if pairs else None
        if compute_ms is None:
            continue
        disk_ms = 1e3 * s["cold_mib_per_step"] * 2**20 / bandwidth
        bound_ms = max(compute_ms, disk_ms)
        s["bound_ms_per_step"] = bound_ms
        s["bound_tok_s"] = 1e3 / bound_ms
        s["of_bound"] = s["decode_tok_s"] / s["bound_tok_s"]


def run_bench(spec: BenchSpec, progress=None) -> dict:
    import tempfile

    model = Path(spec.model)
    files = expert_files(model)
    bandwidth = disk_bandwidth(files)
    if spec.read_mbps is not None:  # the throttle is the device the arms see
        bandwidth = min(bandwidth, spec.read_mbps * 1e6)
    if spec.readers is None:  # one count for every arm, ARM@before too: the model's default
        from engine.manifest import read_manifest
        from engine.queue_depth import default_readers

        spec.readers = default_readers(model, read_manifest(model).bundle_bytes)[0]
    arms = all_arms(spec)
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    order_log = []
    tokens: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="ssdmoe-bench-") as tmp:
        for r in range(spec.rounds):
            order = arms[r % len(arms):] + arms[:r % len(arms)]
            order_log.append(order)
            for arm in order:
                if progress:
                    progress(f"round {r + 1}/{spec.rounds}: {arm}")
                # warm: every expert in the page cache (not under a memory limit, where the
                # worker starts its emulated machine cold and warms within the limit)
                if base_arm(arm) in STREAMING and spec.page_cache_budget is None \
                        and spec.mem_limit is None:
                    warm_files(expert_files(Path(spec.before))
                               if arm.endswith(BEFORE) and spec.before else files)
                result = _spawn(arm, spec, Path(tmp))
                runs[arm].append(result)
                if not result.get("killed"):
                    tokens.setdefault(arm, [p["tokens"] for p in result["prompts"]])
    # the predicted-routing arms run the base model with other routing: other tokens
    same = {a: t for a, t in tokens.items() if base_arm(a) not in PREDICTED}
    ref = next(iter(same.values()), None)
    agreement = {}
    for arm in PREDICTED:
        if arm in tokens and ref is not None:
            pairs = [(a, b) for p, q in zip(tokens[arm], ref, strict=True)
                     for a, b in zip(p, q, strict=False)]
            agreement[arm] = sum(a == b for a, b in pairs) / len(pairs)
    from engine.manifest import MANIFEST_FILE, sha256_file

    return resummarize({
        "model": str(model), "manifest_sha256": sha256_file(model / MANIFEST_FILE),
        "arms": arms, "rounds": spec.rounds, "before": spec.before,
        "before_manifest_sha256": sha256_file(Path(spec.before) / MANIFEST_FILE)
        if spec.before else None,
        "before_code": None if spec.before_code is None else checkout(spec.before_code),
        "code": checkout(str(Path(__file__).resolve().parents[2])), "readers": spec.readers,
        "native_reads": spec.native_reads, "before_native_reads": spec.before_native_reads,
        "cache_policy": spec.cache_policy or "lru",
        "max_tokens": spec.max_tokens, "prompts": spec.prompts,
        "page_cache_budget": spec.page_cache_budget, "expert_bytes": expert_bytes(model),
        "disk_bandwidth_bytes_s": bandwidth, "order": order_log,
        "tokens_identical": all(t == ref for t in same.values()),
        # share of positions equal to the base tokens, per predicted-routing arm
        "prerouter_token_agreement": agreement.get("staged-prerouter"),
        "predicted_token_agreement": agreement,
        # a hint never routes: its tokens are the heads' own (None without both arms)
        "hint_tokens_identical": tokens["staged-prerouter-hint"] == tokens["staged-prerouter"]
        if "staged-prerouter-hint" in tokens and "staged-prerouter" in tokens else None,
        "decode_routing": decode_routing(spec.temp, spec.seed),
        "throttle": None if spec.read_mbps is None and spec.read_iops is None else
        {"read_mbps": spec.read_mbps, "read_iops": spec.read_iops},
        "machine_limits": limits_of(spec).to_dict(),
        "runs": runs, "machine": _machine(),
    })


def resummarize(result: dict) -> dict:
    """(Re)compute `summary` from the raw per-round `runs` of a result."""
    result["summary"] = {a: summarize_arm(result["runs"][a]) for a in result["arms"]}
    add_bounds(result["summary"], result["disk_bandwidth_bytes_s"])
    add_before_ratios(result["summary"])
    result["lora_cost"] = lora_cost(result["summary"])
    return result


def lora_cost(summary: dict[str, dict]) -> dict | None:
    """What the recovery LoRA costs: decode tok/s of staged-prerouter-lora over staged-prerouter
    (paired within rounds, then the median), and the adapter's load time and bytes."""
    a, b = summary.get("staged-prerouter-lora"), summary.get("staged-prerouter")
    if a is None or b is None:
        return None
    paired = statistics.median(x / y for x, y in zip(a["decode_tok_s_rounds"],
                                                     b["decode_tok_s_rounds"], strict=True))
    return {"decode_ratio_paired": paired, "step_ms_added": a["step_ms"] - b["step_ms"],
            "load_s": a.get("lora_load_s"), "bytes": a.get("lora_bytes")}


def checkout(path: str) -> dict:
    """Where a checkout's code stands: its path, git commit and whether files differ from it
    (commit None where git cannot say)."""
    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", "-C", path, *args], capture_output=True, text=True,
                               timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"path": str(Path(path).resolve()), "commit": git("rev-parse", "HEAD"),
            "modified": None if status is None else bool(status)}


def _spawn(arm: str, spec: BenchSpec, tmp: Path) -> dict:
    from contract.errors import BadInput

    spec_file, out_file = tmp / f"{arm}.spec.json", tmp / f"{arm}.out.json"
    out_file.unlink(missing_ok=True)
    before = arm.endswith(BEFORE)
    model = spec.before if before and spec.before else spec.model

    def absolute(path: str | None) -> str | None:  # the worker may run in another checkout
        return None if path is None else str(Path(path).resolve())

    spec_file.write_text(json.dumps({
        "arm": base_arm(arm), "model": absolute(model), "prompts": spec.prompts,
        "max_tokens": spec.max_tokens, "readers": spec.readers,
        "native_reads": spec.native_reads if not before or spec.before_native_reads is None
        else spec.before_native_reads, "cache_policy": spec.cache_policy,
        "page_cache_budget": spec.page_cache_budget, "warmup_tokens": spec.warmup_tokens,
        "temp": spec.temp, "seed": spec.seed, "limits": limits_of(spec).to_dict(),
        "prerouter": absolute(spec.prerouter or str(Path(spec.model) / "prerouter")),
        "lora": absolute(spec.lora)}))
    cmd = [sys.executable, "-m", "engine.bench.arm", str(spec_file), str(out_file)]
    cwd, env = None, None
    if before and spec.before_code:  # the other checkout's engine, this environment
        cwd, env = spec.before_code, importing(spec.before_code)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=spec.timeout_s,
                           cwd=cwd, env=env)
    except subprocess.TimeoutExpired:
        raise BadInput(f"bench arm {arm}: timed out after {spec.timeout_s} s") from None
    if p.returncode < 0 and spec.mem_limit is not None:
        # killed by a signal under a memory limit: what the emulated machine did to the arm
        oom = p.returncode == -signal.SIGKILL
        return {"arm": arm, "killed": "out of memory (SIGKILL under the memory limit)" if oom
                else f"signal {-p.returncode}"}
    if p.returncode != 0 or not out_file.exists():
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise BadInput(f"bench arm {arm}: worker failed ({last})")
    return json.loads(out_file.read_text())


def limits_of(spec: BenchSpec):
    """The emulated machine of each worker (an empty MachineLimits: this machine)."""
    from engine.machine_limits import MachineLimits
    from engine.throttle import ThrottleSpec

    return MachineLimits(mem_limit=spec.mem_limit, cpus=spec.cpus, cpu_quota=spec.cpu_quota,
                         throttle=ThrottleSpec(spec.read_mbps, spec.read_iops))


def _machine() -> dict:
    import platform

    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version()}


# ---------------------------------------------------------------- report


def table_rows(result: dict) -> list[list[str]]:
    rows = []
    for arm, s in result["summary"].items():
        if "step_ms" not in s:  # killed in every round
            rows.append([arm, f"killed: {s['killed']}"] + ["-"] * (len(HEADERS) - 2))
            continue
        ratio = s.get("ratio_to_resident")
        rows.append([
            arm, f"{s['decode_tok_s']:.1f}", f"{s['prefill_tok_s']:.1f}",
            "-" if ratio is None else f"{ratio:.2f}x",
            _num(s.get("ratio_paired"), ".2f", "x"),
            f"{s['blocked_ms_per_step']:.2f}", f"{s['cpu_ms_per_step']:.1f}",
            f"{s['loads_per_step']:.1f}",
            f"{s['cold_mib_per_step']:.2f}",
            f"{s['peak_mlx_bytes'] / 2**20:.0f}", f"{s['peak_rss_bytes'] / 2**20:.0f}",
            "-" if "bound_tok_s" not in s else f"{s['bound_tok_s']:.1f}",
            "-" if "of_bound" not in s else f"{s['of_bound']:.2f}",
            _num(s.get("read_syscalls_per_load"), ".2f"),
            _num(s.get("device_reads_per_cold_load"), ".2f"),
            _num(s.get("cold_load_ms"), ".3f"),
            _num(s.get("cold_load_covered_ms"), ".3f"),
            _num(s.get("cold_reads_in_flight"), ".2f"),
            _num(s.get("over_before_paired"), ".2f", "x"),
        ])
    return rows


HEADERS = ["arm", "decode tok/s", "prefill tok/s", "vs resident", "paired", "blocked ms/step",
           "CPU ms/step", "loads/step", "cold MiB/step", "MLX peak MiB", "RSS peak MiB",
           "bound tok/s", "of bound", "read calls/load", "device reads/cold load",
           "cold load ms", "covered ms/cold load", "cold reads in flight", "vs @before"]


def _num(v, fmt: str, unit: str = "") -> str:
    """A figure for the table: '-' where absent or unknown (nan)."""
    return "-" if v is None or v != v else f"{v:{fmt}}{unit}"


def markdown_table(result: dict) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(result)]
    return "\n".join(lines)
