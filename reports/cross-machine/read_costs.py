"""What a bundle read costs inside on-demand decode against the same read alone: wall and the
reading thread's CPU of `ExpertStore.read_bundle`, cold and warm, minor faults per read.

  in decode  the on-demand preset (the exact path, reads on the main thread) with the engine's
             page-cache budget at --page-cache of the expert bytes, sampled decoding; each
             read_bundle call timed (the budget's page drops of an eviction included: the
             trace's load rows leave them out); a read slower than --cold-ms counts as cold
  alone      the first MoE layer's bundles read through the store into one row of a stack, in
             turn cold (the layer file's pages dropped first) and warm (every bundle of the
             layer read once before), alternating; each also into the first row of a stack
             of K rows that MLX has just zero-filled (as the exact path's reads inside decode)

Usage: uv run python reports/cross-machine/read_costs.py [--model models/tiny-trained-wide-stream]
[--page-cache 0.25] [--tokens 32]; writes read_costs.json beside this script. Linux
(POSIX_FADV_DONTNEED, RUSAGE_THREAD)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))


def _timed(read):
    """read() timed: (wall ms, thread CPU ms, minor faults)."""
    f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    t0, c0 = time.perf_counter(), time.thread_time()
    read()
    return ((time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3,
            resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)


def in_decode(model: Path, fraction: float, tokens: int) -> list[tuple[float, float, int]]:
    from contract.engine_config import EngineConfig
    from engine import store as store_module
    from engine.capture import expert_bytes
    from engine.generate import generate
    from engine.loader import load_streaming, open_manifest

    budget = int(fraction * expert_bytes(open_manifest(model, verify=False)))
    eng = load_streaming(model, config=EngineConfig.from_preset("on-demand",
                                                                page_cache_budget=budget))
    rows: list[tuple[float, float, int]] = []
    original = store_module.ExpertStore.read_bundle

    def read_bundle(self, layer, expert, into, **kw):
        out = []
        rows.append(_timed(lambda: out.append(original(self, layer, expert, into, **kw))))
        return out[0]

    store_module.ExpertStore.read_bundle = read_bundle
    try:
        run = dict(temp=1.0, stop_at_eos=False, runtime=eng.runtime)
        generate(eng.model, eng.tokenizer, "Once upon a time", 8, seed=0, **run)
        rows.clear()
        generate(eng.model, eng.tokenizer, "The history of the printing press", tokens, seed=1,
                 **run)
    finally:
        store_module.ExpertStore.read_bundle = original
    return rows


def alone(model: Path, reps: int = 30) -> dict[str, list[tuple[float, float, int]]]:
    import numpy as np

    from engine.loader import open_manifest
    from engine.paths.kernel import alloc_stack, row_views
    from engine.store import ExpertStore

    manifest = open_manifest(model, verify=False)
    kinds = ("cold", "warm", "cold, fresh stack", "warm, fresh stack")
    out: dict[str, list[tuple[float, float, int]]] = {kind: [] for kind in kinds}
    with ExpertStore(manifest) as store:
        layer = manifest.moe_layers[0]
        shapes = store.expert_shapes(layer)
        _, views = alloc_stack(shapes, 1)
        reused = row_views(views, 0)
        fd = store._files[layer].fd
        rng = np.random.default_rng(0)
        for i in range(reps):
            expert = int(rng.integers(0, manifest.num_experts))
            for kind in (kinds if i % 2 == 0 else kinds[::-1]):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                if kind.startswith("warm"):
                    for e in range(manifest.num_experts):
                        store.read_bundle(layer, e, reused)
                # "fresh stack": a row of a stack MLX's compute thread has just zero-filled, as
                # the exact path reads into inside decode
                into = row_views(alloc_stack(shapes, manifest.top_k)[1], 0) \
                    if kind.endswith("fresh stack") else reused
                out[kind].append(_timed(lambda e=expert, t=into: store.read_bundle(layer, e, t)))
    return out


def _summary(rows: list[tuple[float, float, int]]) -> dict[str, float]:
    return {"reads": len(rows),
            "wall_ms": statistics.median(r[0] for r in rows) if rows else float("nan"),
            "cpu_ms": statistics.median(r[1] for r in rows) if rows else float("nan"),
            "minor_faults": statistics.median(r[2] for r in rows) if rows else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-trained-wide-stream")
    ap.add_argument("--page-cache", type=float, default=0.25)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--cold-ms", type=float, default=0.9,
                    help="a read in decode slower than this counts as cold")
    args = ap.parse_args()
    from contract.errors import BadInput

    try:
        decode = in_decode(args.model, args.page_cache, args.tokens)
        solo = alone(args.model)
    except BadInput as err:
        sys.exit(f"read_costs: {err}")
    result = {
        "command": "uv run python reports/cross-machine/read_costs.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip(),
        "model": str(args.model), "page_cache": args.page_cache, "cold_ms": args.cold_ms,
        "in_decode": {"cold": _summary([r for r in decode if r[0] > args.cold_ms]),
                      "warm": _summary([r for r in decode if r[0] <= args.cold_ms])},
        "alone": {kind: _summary(rows) for kind, rows in solo.items()},
    }
    (HERE / "read_costs.json").write_text(json.dumps(result, indent=1) + "\n")
    print("| read | where | reads | wall ms | thread CPU ms | minor faults |")
    print("|---|---|---|---|---|---|")
    for where in ("in_decode", "alone"):
        for kind, s in result[where].items():
            print(f"| {kind} | {where.replace('_', ' ')} | {s['reads']} | {s['wall_ms']:.3f} | "
                  f"{s['cpu_ms']:.3f} | {s['minor_faults']:g} |")


if __name__ == "__main__":
    main()
