"""A probe's capture: the engine's own capture (engine.capture: load, record, decode the
prompts), run in a process of its own with the probe's hooks, and the kernel's per-thread
scheduler statistics (/proc/self/task/*/schedstat) written when it ends. The stall and idle
probes each start one per arm with `python -m <probe> SPEC`, SPEC this module's JSON."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class CaptureSpec:
    model: str
    out: str  # the trace directory (replaced)
    stats: str  # where the schedstat JSON goes
    tokens: int
    preset: str
    prompts: str | None = None  # None: the default prompts
    temp: float = 1.0
    seed: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CaptureSpec:
        return cls(**json.loads(text))


def task_schedstat(path: str | Path) -> tuple[float, float, int]:
    """One task's /proc schedstat: (CPU ms, run-queue wait ms, timeslices)."""
    run, wait, slices = map(int, Path(path).read_text().split())
    return run / 1e6, wait / 1e6, slices


def thread_stats(pid: int | str = "self") -> dict[str, dict[str, float]]:
    """{task id: {"run_ms", "runqueue_ms", "switches"}} for every thread of the process."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            run, wait, slices = task_schedstat(task / "schedstat")
        except (OSError, ValueError):
            continue
        out[task.name] = {"run_ms": run, "runqueue_ms": wait, "switches": slices}
    return out


def run(spec: CaptureSpec, *, on_step: Callable[[dict], None] | None = None,
        read_hook: Callable[[], None] | None = None,
        stats: Callable[[], dict] = thread_stats) -> None:
    """Capture `spec` with the hooks (`on_step` after the recorder; `read_hook` as each expert
    read ends), then write `stats()` to spec.stats."""
    from engine.capture import (
        DEFAULT_PROMPTS,
        capture,
        load_engine,
        prepare_out_dir,
        read_prompts,
        start_recorder,
    )
    from traces.regime import decode_routing

    texts = read_prompts(spec.prompts or DEFAULT_PROMPTS)
    engine = load_engine(spec.model, preset=spec.preset)
    try:
        engine.store.read_hook = read_hook
        out = prepare_out_dir(Path(spec.out), force=True)
        extra = {"capture": {"prompts_file": str(spec.prompts or DEFAULT_PROMPTS),
                             "prompts": len(texts), "max_tokens": spec.tokens,
                             "temp": spec.temp, "seed": spec.seed,
                             "decode_routing": decode_routing(spec.temp, spec.seed),
                             "prefill_step_size": 2048, "stop_at_eos": False}}
        with start_recorder(out, engine, extra=extra) as rec:
            capture(engine, texts, spec.tokens, recorder=rec, temp=spec.temp, seed=spec.seed,
                    on_step=on_step)
    finally:
        engine.close()
    Path(spec.stats).write_text(json.dumps(stats()))
