"""Break each simulated mechanism in turn and check that a test fails (issue 46: every mechanism
has a test that fails when it is broken). Each mutant edits one line in a scratch worktree of
HEAD, runs the simulator's tests (not the slow ones), and is reported CAUGHT or NOT CAUGHT.

    uv run python scripts/break_mechanisms.py            # ~9 min on 2 cores
    uv run python scripts/break_mechanisms.py "gil hand-over"

A run of the whole list writes its table to reports/transfer/mechanisms.md."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "reports" / "transfer" / "mechanisms.md"
# (mechanism, file, line as it is, line broken)
MUTANTS = [
    ("gil hand-over", "sim/gil.py", "        yield self.env.timeout(self.handoff_s)",
     "        yield self.env.timeout(0.0)"),
    ("swap hit cost", "sim/swap.py", "        return self._read(now, nbytes)\n",
     "        return 0.0\n"),
    ("cold read CPU per page", "sim/loads.py",
     "            return self.cold_read_cpu * cold_share + -(-cold_bytes // PAGE) * "
     "self.cold_page_cpu", "            return self.cold_read_cpu * cold_share"),
    ("reader hand-off", "sim/main_thread.py",
     "            yield self.env.timeout(self.readers.handoff_s)",
     "            yield self.env.timeout(0.0)"),
    ("device latency per request", "sim/storage.py",  # Device.transfer: what loads use
     "            yield env.timeout(self.latency_s * requests)",
     "            yield env.timeout(self.latency_s)"),
    ("device latency per request, the FIFO read (swap page-ins)", "sim/storage.py",
     "        xfer = start + self.latency_s * requests", "        xfer = start + self.latency_s"),
    ("bounded async queue", "sim/compute_stream.py", "        self.queue_ahead_s = queue_ahead_s",
     "        self.queue_ahead_s = None"),
    ("refused residency ask", "sim/main_thread.py",
     "        self.refused_warm_s = hw.refused_warm_ms / 1e3", "        self.refused_warm_s = 0.0"),
    ("app caches take from the page cache", "sim/memory_budget.py",
     "        return (self.resident + self.kv + self.heads + self.adapter + self.lru + self.slots",
     "        return (self.resident + self.kv + self.heads + self.adapter + self.slots"),
    ("cores shared by the threads", "sim/cpu.py",
     "            rate = min(1.0, self.capacity / len(sleepers))", "            rate = 1.0"),
    ("sleepers run before the compute thread", "sim/cpu.py",
     "        hogs = {k for k, job in self.jobs.items() if job[2] == COMPUTE_THREAD}",
     "        hogs: set[int] = set()"),
    ("one core hands work over without crossing cores", "sim/main_thread.py",
     "        if hw.threads_share_one_core:  # hand-overs to the compute thread stay on one core",
     "        if False:"),
    ("blk-throttle trims whole slices", "sim/token_bucket.py",
     "            self._disp = max(0.0, self._disp - self.rate * s * done)", "            pass"),
    ("token bucket burst cap", "sim/token_bucket.py",
     "        level = min(self.capacity, self._level + self.rate * (t - self._at))",
     "        level = self._level + self.rate * (t - self._at)"),
    ("page cache fills on a cold read", "sim/page_cache.py",
     "            self.lru.insert(key, now)\n", "            pass\n"),
    ("the exact path's zeroed stack", "sim/main_thread.py",
     "            yield from self._fill_stack(len(set(executed)))",
     "            yield from self._fill_stack(1)"),
    ("the budget's page drops per page", "sim/compare.py",
     "            drops = pages * sc.hardware.page_drop_us_per_page / 1e3",
     "            drops = 0.0"),
    ("direct reclaim under a memory limit", "sim/loads.py",
     "            yield self.cores.work(evicted * self.reclaim_s, thread)",
     "            pass"),
    ("the device's bandwidth shared by the reads in flight", "sim/storage.py",
     "        return 1.0 / n if n > 1 else 1.0", "        return 1.0"),
    ("direct reclaim at its measured cost per page", "sim/loads.py",
     "        per_page = hw.reclaim_us_per_page or hw.page_drop_us_per_page",
     "        per_page = hw.page_drop_us_per_page"),
    ("the zero fill slows past the CPU's caches", "sim/zero_fill.py",
     "    if not hw.zero_fill_rotation_mib:", "    if True:"),
    ("a measured rate read between two sizes", "sim/rate_curve.py",
     "            return 1.0 / ((1 - share) / rates[i - 1] + share / rates[i])",
     "            return rates[i - 1]"),
    ("the expert kernel's rate at the model's bundle size", "sim/expert_kernel.py",
     "    at = rate_at(sizes, rates, bundle_bytes)", "    at = rates[0]"),
    ("the in-decode factor leaves the kernel's time per byte", "sim/main_thread.py",
     "        expert_bw = rate * 1e9 if rate else bw",
     "        expert_bw = rate * 1e9 / hw.compute_factor if rate else bw"),
    ("a step touches its stacks' source pages", "sim/zero_fill.py",
     "    return 2.0 * m.layers * k * m.bundle_bytes + m.resident_bytes",
     "    return 1.0 * m.layers * k * m.bundle_bytes + m.resident_bytes"),
    ("kernel refault activation", "sim/two_list_lru.py",
     "        if stamp is not None and self.evictions - stamp <= len(self.active):",
     "        if False:"),
    ("blk-throttle grants whole slices", "sim/token_bucket.py",
     "        whole = max(1, math.ceil(elapsed / s - 1e-9)) * s  # rounded up to whole slices",
     "        whole = max(elapsed, 1e-9)"),
    ("blk-throttle's slice outlasts each request", "sim/token_bucket.py",
     "        self._end = max(self._end, passes + s)",
     "        self._end = max(self._end, passes)"),
    ("one transfer pipe behind the queue slots", "sim/storage.py",
     "        if self._pipe_free > xfer:\n            xfer = self._pipe_free\n", ""),
    ("a second read activates a page", "sim/two_list_lru.py",
     "            self.active[key] = self.inactive.pop(key)",
     "            self.inactive.move_to_end(key)"),
    ("the active list shrinks to the inactive's size", "sim/two_list_lru.py",
     "        while self.active and len(self.inactive) < len(self.active):",
     "        while False:"),
    ("the page cache keeps its floor", "sim/memory_budget.py",
     "        return max(self.left, min(self.page_cache_floor, max(self.ram - self.os_held, 0)))",
     "        return max(self.left, 0)"),
    ("memory beyond the RAM is swapped", "sim/memory_budget.py",
     "        return max(self.unreclaimable + self.page_cache - self.ram, 0)", "        return 0"),
    ("an idle reader wakes late", "sim/reader_threads.py", "            if idle and self.wake_s:",
     "            if False:"),
    ("an async item past the bound is split there", "sim/compute_stream.py",
     "        if seconds > q:  # the point q before the end lies in this item: split it there",
     "        if False:"),
    ("the main thread dispatches while it waits on compute", "sim/main_thread.py",
     "        self.dispatch_owed += self.dispatch_cpu_s", "        pass"),
    ("a head's compute is what a step reads", "sim/main_thread.py",
     "        self.head_s = (m.head_read_bytes or m.head_bytes) / bw  # what a head reads a step",
     "        self.head_s = m.head_bytes / bw"),
    ("a staged fill's host work per load", "sim/main_thread.py",
     "        self.fill_host_s = hw.fill_host_ms_per_load / 1e3 if policy.slots else 0.0",
     "        self.fill_host_s = 0.0"),
    ("the lookahead loop dispatches each layer once", "sim/main_thread.py",
     "        self.dispatch_owed += max(0.0, self.dispatch_cpu_s - dispatched)",
     "        self.dispatch_owed += self.dispatch_cpu_s"),
    ("the compute thread waits for the dispatch first", "sim/compute_stream.py",
     "        wait = min(wait, seconds) if self.cores is not None else 0.0",
     "        wait = 0.0"),
    ("on one core the compute thread's wait is the dispatch", "sim/main_thread.py",
     "        self.compute_wait_s = 0.0\n", "        pass\n"),
    ("a graph_of model takes its graph's in-decode figures", "sim/compare.py",
     "            sc.in_decode = dict(load_scenario(graph).in_decode)",
     "            sc.in_decode = {}"),
]


def tests(tree: Path) -> list[str]:
    sim = sorted(p.relative_to(tree).as_posix() for p in (tree / "tests").glob("test_sim*.py")
                 if "sweep" not in p.name)
    return [*sim, "tests/test_compare_graph_of.py", "tests/test_cpu_per_step.py",
            "tests/test_page_sharing.py", "tests/test_transfer.py", "tests/test_zero_fill.py",
            "tests/test_expert_kernel.py"]


def main(names: list[str]) -> int:
    unknown = [n for n in names if n not in {m[0] for m in MUTANTS}]
    if unknown:
        print(f"break_mechanisms: unknown mechanism {', '.join(map(repr, unknown))} (known: "
              f"{', '.join(m[0] for m in MUTANTS)})", file=sys.stderr)
        return 2
    missed, rows, began = 0, [], time.time()
    with tempfile.TemporaryDirectory(prefix="ssdmoe-mutants-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), "HEAD"], cwd=ROOT,
                       check=True)
        try:
            for name, rel, old, new in MUTANTS:
                if names and name not in names:
                    continue
                path = tree / rel
                src = path.read_text()
                if src.count(old) != 1:
                    print(f"{name}: {rel} no longer has the line to break (update this list)")
                    missed += 1
                    continue
                path.write_text(src.replace(old, new))
                try:
                    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p",
                                          "no:cacheprovider", "-m", "not slow", *tests(tree)],
                                         cwd=tree, capture_output=True, text=True)
                finally:
                    path.write_text(src)
                caught = run.returncode != 0
                missed += not caught
                tail = run.stdout.strip().splitlines()[-1:] or ["(no output)"]
                verdict = "CAUGHT" if caught else "NOT CAUGHT"
                rows.append(f"| {name} | {verdict} | {tail[0]} |")
                print(f"{name}: {verdict} ({tail[0]})", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    if not names:
        write_report(rows, missed, time.time() - began)
    return 1 if missed else 0


def write_report(rows: list[str], missed: int, seconds: float) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short=8", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    intro = (
        f"`uv run python scripts/break_mechanisms.py` on {commit} ({when}, "
        f"{seconds / 60:.0f} min): each mechanism broken in turn, one line, in a worktree of "
        "HEAD, and the simulator's tests run (not the slow ones). Before this list existed, the "
        "token bucket without its burst cap passed every test; `tests/test_sim_throttle.py` now "
        f"works a long idle by hand. {len(MUTANTS) - missed} of {len(MUTANTS)} caught.")
    REPORT.write_text("# Each simulated mechanism, broken: does a test fail?\n\n"
                      + textwrap.fill(intro, 96) + "\n\n| mechanism | broken | tests |\n"
                      "|---|---|---|\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
