"""One `ssdmoe bench` arm, in its own process (engine.bench.benchmark spawns `python -m
engine.bench.arm SPEC OUT`): load the model the arm's way, warm up, reset the peaks, run the
prompts, and write the arm's figures as JSON. The arms are described in engine.bench."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from engine.bench.benchmark import STREAMING


def _rss_peak() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def read_syscalls() -> int:
    """Read-class system calls this process has made, every thread's (the kernel's count,
    /proc/self/io syscr); -1 where the kernel does not say."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("syscr:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def covered_ns(spans: list[tuple[int, int]]) -> int:
    """Nanoseconds inside at least one of `spans` ([start, end) pairs): the time the readers
    had a cold read in flight, however many at once."""
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def device_reads(path: str) -> int:
    """Reads completed by the block device holding `path` (/sys/dev/block/MAJ:MIN/stat, the
    first field), every process's: -1 where unknown. A partition counts its own."""
    try:
        dev = os.stat(path).st_dev
        stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat").read_text()
        return int(stat.split()[0])
    except (OSError, ValueError, IndexError):
        return -1


def _reset_rss_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _resident_run(model, tok, prompt: str, n: int, temp: float = 0.0, seed: int = 0) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    ids = tok.encode(prompt)
    tokens = []
    mx.random.seed(seed)
    sampler = make_sampler(temp)
    t0 = time.perf_counter()
    t1, c1 = t0, time.process_time()
    for i, (t, _) in enumerate(generate_step(mx.array(ids), model, max_tokens=n,
                                             sampler=sampler)):
        if i == 0:
            t1, c1 = time.perf_counter(), time.process_time()
        tokens.append(int(t))
    t2 = time.perf_counter()
    return {"prompt_tokens": len(ids), "prefill_s": t1 - t0, "decode_s": t2 - t1,
            "decode_cpu_s": time.process_time() - c1, "decode_steps": len(tokens) - 1,
            "tokens": tokens}


def _sync_routers(model, model_dir: str) -> None:
    """Make every MoE block bring its router logits to the host, as on-demand paths do."""
    import mlx.nn as nn
    import numpy as np

    from engine.archs import ARCHS
    from engine.manifest import read_manifest

    class SyncedRouter(nn.Module):
        def __init__(self, gate):
            super().__init__()
            self.inner = gate

        def __call__(self, x):
            out = self.inner(x)
            np.array(out[0] if isinstance(out, tuple) else out)  # the host sync
            return out

    m = read_manifest(Path(model_dir))
    for i in m.moe_layers:
        block = getattr(model.layers[i], ARCHS[m.model_type].moe_attr)
        block.gate = SyncedRouter(block.gate)


def run_arm(spec: dict) -> dict:
    """Worker body: load the arm's model, warm up, run the prompts, return measurements."""
    import mlx.core as mx

    from contract.engine_config import EngineConfig
    from engine.generate import generate
    from engine.loader import load_resident, load_streaming, streaming_blocks
    from engine.oracle import RoutingReplay

    arm, model_dir, n = spec["arm"], spec["model"], spec["max_tokens"]
    prompts = spec["prompts"]
    t_load = time.perf_counter()
    loads: list[dict] = []
    engine = store = rt = None
    if arm in ("resident", "engine-resident", "resident-sync"):
        model, tok = load_resident(model_dir)
        if arm == "resident-sync":
            _sync_routers(model, spec["model"])
    else:
        cached = STREAMING[arm] != "on-demand" or spec["page_cache_budget"] is not None
        config = EngineConfig.from_preset(STREAMING[arm],
                                          page_cache_budget=spec["page_cache_budget"],
                                          lead=1 if arm == "staged-oracle" else 0,
                                          lead_kind="layer" if arm == "staged-layer"
                                          else "none",
                                          prerouter=spec.get("prerouter")
                                          if arm.startswith("staged-prerouter") else None,
                                          first_layer_hint=arm == "staged-prerouter-hint",
                                          lora=spec.get("lora")
                                          if arm == "staged-prerouter-lora" else None,
                                          readers=spec.get("readers"),
                                          native_reads=spec.get("native_reads", False),
                                          cache_policy=spec.get("cache_policy")
                                          if cached else None)
        engine = load_streaming(model_dir, config=config, on_load=loads.append)
        model, tok, store, rt = engine.model, engine.tokenizer, engine.store, engine.runtime
    load_s = time.perf_counter() - t_load

    expert_file = str(store.manifest.path(store.manifest.layers[store.manifest.moe_layers[0]]
                                          .file)) if store is not None else ""

    def engine_run(prompt: str, tokens: int, on_step_start=None) -> dict:
        cpu, io = [], []

        def on_start(step: int, phase: str, n_tokens: int) -> None:
            if phase == "decode" and not cpu:
                cpu.append(time.process_time())
                io.extend((read_syscalls(), device_reads(expert_file)))
            if on_step_start is not None:
                on_step_start(step, phase, n_tokens)

        r = generate(model, tok, prompt, tokens, temp=spec.get("temp", 0.0),
                     seed=spec.get("seed", 0), stop_at_eos=False, runtime=rt,
                     on_step_start=on_start)
        ended = (read_syscalls(), device_reads(expert_file))
        steps = [s for s in r.steps if s["phase"] == "decode"]
        return {"prompt_tokens": r.prompt_tokens, "prefill_s": r.prefill_s,
                "decode_s": r.decode_s, "decode_cpu_s": time.process_time() - cpu[0],
                "decode_steps": len(steps), "tokens": r.tokens,
                "decode_step_ids": [s["step"] for s in steps],
                # the kernel's counts over decode (-1: not known here)
                "decode_read_syscalls": ended[0] - io[0] if min(io[0], ended[0]) >= 0 else -1,
                "decode_device_reads": ended[1] - io[1] if min(io[1], ended[1]) >= 0 else -1}

    def run(prompt: str, tokens: int, replay=None) -> dict:
        if arm == "resident":
            return _resident_run(model, tok, prompt, tokens, spec.get("temp", 0.0),
                                 spec.get("seed", 0))
        if replay is not None:
            return engine_run(prompt, tokens, on_step_start=replay.driver(rt.staged()))
        return engine_run(prompt, tokens)

    # Warm-up (JIT-compiles MLX kernels, fills slots/LRU rows): not timed.
    run(prompts[0], spec["warmup_tokens"])
    replays = []
    if arm == "staged-oracle":  # record each prompt's routing in an identical untimed run
        for p in prompts:
            replay = RoutingReplay()
            on_start, on_routing, finish = replay.recorder()
            for b in streaming_blocks(model).values():
                b.on_routing = on_routing
            engine_run(p, n, on_step_start=on_start)
            finish()
            replays.append(replay)
        for b in streaming_blocks(model).values():
            b.on_routing = None
    if store is not None and spec["page_cache_budget"] is not None:
        store.drop_page_cache()
    mx.reset_peak_memory()
    _reset_rss_peak()
    loads.clear()
    before = rt.stats.snapshot() if rt else {}
    results = []
    for i, p in enumerate(prompts):
        first = len(loads)
        r = run(p, n, replays[i] if replays else None)
        if arm == "staged-oracle":
            for path in rt.staged().values():
                path.verify()
        decode_ids = set(r.pop("decode_step_ids", []))
        rows = [x for x in loads[first:] if x["step"] in decode_ids]
        r["decode_loads"] = len(rows)
        r["decode_blocked_ns"] = sum(x["wait_ns"] for x in rows)
        r["decode_cold_bytes"] = sum(x["bytes"] for x in rows if x["cold"])
        r["decode_cold_loads"] = sum(1 for x in rows if x["cold"])
        r["cold_load_ms"] = [(x["finished_ns"] - x["started_ns"]) / 1e6 for x in rows
                             if x["cold"]]
        # at a queue depth above 1 a load's own span includes the reads beside it: the span
        # the cold reads covered together, per cold load, is the time each one cost
        r["cold_reading_ns"] = covered_ns([(x["started_ns"], x["finished_ns"]) for x in rows
                                           if x["cold"]])
        r["decode_bytes"] = sum(x["bytes"] for x in rows)
        results.append(r)
    stats = rt.stats.delta(rt.stats.snapshot(), before) if rt else {}
    out = {
        "arm": arm, "load_s": load_s, "loadavg": os.getloadavg(), "prompts": results,
        "stats": stats,
        "peak_mlx_bytes": int(mx.get_peak_memory()), "peak_rss_bytes": _rss_peak(),
        "buffer_bytes": rt.buffer_bytes() if rt else {},
        "config": rt.config.to_dict() if rt else None,
        "lora_load_s": rt.lora.load_s if rt and rt.lora else None,
        "lora_bytes": rt.lora.nbytes if rt and rt.lora else None,
    }
    if engine is not None:
        engine.close()
    return out


def worker_main(argv: list[str]) -> None:
    from engine.machine_limits import EmulatedMachine, MachineLimits

    spec = json.loads(Path(argv[0]).read_text())
    # the whole arm, its model load included, runs on the emulated machine. A streaming arm
    # must fit its resident weights (a limit below them is refused in one line); resident
    # mlx-lm is let run into the limit, since what the kernel then does to it is the result
    model = Path(spec["model"])
    weights = model / "resident.safetensors"
    to_load = weights.stat().st_size if spec["arm"] in STREAMING and weights.is_file() else 0
    with EmulatedMachine(model, MachineLimits.from_dict(spec["limits"]), to_load=to_load) as m:
        result = run_arm(spec)
        result["throttle"] = m.throttle_record()
        result["machine"] = m.record()
    Path(argv[1]).write_text(json.dumps(result))


if __name__ == "__main__":
    from contract.errors import BadInput

    try:
        worker_main(sys.argv[1:])
    except BadInput as err:  # one line for the parent to pass on (engine.bench._spawn)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
