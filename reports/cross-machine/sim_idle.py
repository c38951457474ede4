"""Where a replay leaves the simulated cores idle: `sim compare` of TRACE on a committed run's
profiles, recording every interval in which no thread has work on the simulated cores, and whether
MLX's compute thread spent it inside a wait for the main thread's dispatch (model
compute_wait_ms_per_layer) or nothing could run (a device read, a wake-up, a hand-off).
Measured on one core, a process's CPU equals its wall time (`main_thread_cpu.py`), so idle on
a simulated one-core machine is a mechanism's error.

The recording wraps two methods of the simulator for the run (sim.cpu.Cores._update and
sim.compute_stream.ComputeStream.__init__) and restores them after; nothing it prints changes
the replay.

Usage: uv run python reports/cross-machine/sim_idle.py TRACE [--profiles DIR]
(DIR: a run's profiles/, default the committed scenarios)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from reports.load_script import load_script  # noqa: E402
from sim import compute_stream, cpu  # noqa: E402
from sim.compare import compare  # noqa: E402
from traces.reader import read_trace  # noqa: E402

WAITING, OTHER = "waiting for the dispatch", "other (reads, wake-ups, hand-offs)"


@contextmanager
def recording(idle: Counter, ms: Counter):
    """While open, each idle interval of the simulated cores adds to idle[(cause, ms)] and
    ms[cause]: WAITING where the compute stream's dispatch waits (its waking_s) grew by the
    whole interval, else OTHER."""
    streams: list[compute_stream.ComputeStream] = []
    init, update = compute_stream.ComputeStream.__init__, cpu.Cores._update
    waited_at: dict[int, float] = {}  # the stream's waking_s when each core server last updated

    def init_recorded(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        streams.append(self)

    def update_recorded(self) -> None:
        elapsed = self.env.now - self._at
        waking = streams[-1].waking_s if streams else 0.0
        if elapsed > 0 and not self.jobs and not self.unbounded:
            grew = waking - waited_at.get(id(self), 0.0)
            cause = WAITING if grew >= elapsed - 1e-12 else OTHER
            idle[(cause, round(elapsed * 1e3, 4))] += 1
            ms[cause] += elapsed * 1e3
        update(self)
        waited_at[id(self)] = waking

    compute_stream.ComputeStream.__init__ = init_recorded
    cpu.Cores._update = update_recorded
    try:
        yield
    finally:
        compute_stream.ComputeStream.__init__ = init
        cpu.Cores._update = update


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--profiles", type=Path, default=None)
    args = ap.parse_args()
    if not (args.trace / "run.json").is_file():
        raise SystemExit(f"sim_idle.py: {args.trace}: not a trace directory (no run.json)")
    idle: Counter = Counter()
    ms: Counter = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        scenario = load_script("io/token-lead/run.py").scenario_file(args.profiles, Path(tmp))
        with recording(idle, ms):
            res = compare(read_trace(args.trace), scenario=scenario)
    steps = res.simulated.get("decode_tok_s")
    print(f"{args.trace}: simulated decode {steps:.2f} tok/s" if steps else str(args.trace))
    print("| idle because | intervals | ms in all | most common length ms |")
    print("|---|---|---|---|")
    for cause, total in ms.most_common():
        lengths = Counter({k[1]: n for k, n in idle.items() if k[0] == cause})
        length, _ = lengths.most_common(1)[0]
        print(f"| {cause} | {sum(lengths.values())} | {total:.1f} | {length} |")


if __name__ == "__main__":
    main()
