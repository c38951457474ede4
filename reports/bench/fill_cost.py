"""Where staged decode loses to resident on a small model: the fill points or the reads?

One process, arms rotated each round, the benchmark's two prompts, greedy tokens:
  engine-resident  the resident model through engine.generate (no fill points)
  staged           preset staged: K + K = 8 sticky slots per layer, misses read on demand
                   (a warm miss copied by the main thread itself: engine.readers)
  staged-readers   the same with every held miss but the first handed to the reader threads
                   (INLINE_WARM_BYTES = 0: the policy before warm misses were copied inline)
  staged-all-hit   preset staged with 64 slots per layer: after warm-up every expert is in
                   a slot, so a step has the same six fill points but reads nothing

Run: uv run python reports/bench/fill_cost.py [MODEL] [--rounds N]
(default models/tiny-trained-stream, 12 rounds: about three minutes). Prints a table and writes
reports/bench/fill-cost.json."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
OUT = Path(__file__).with_name("fill-cost.json")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(ROOT / "models" / "tiny-trained-stream"))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    if not Path(args.model, "manifest.json").is_file():
        sys.exit(f"{args.model}: no converted model (uv run ssdmoe convert models/tiny-trained "
                 "models/tiny-trained-stream)")

    import engine.readers
    from contract.engine_config import EngineConfig
    from engine.bench.benchmark import PROMPTS, load_prompts
    from engine.generate import generate
    from engine.loader import load_resident, load_streaming

    resident, rtok = load_resident(args.model)
    staged = load_streaming(args.model, config=EngineConfig.from_preset("staged"))
    experts = staged.manifest.num_experts
    k = staged.manifest.top_k
    all_hit = load_streaming(args.model, config=EngineConfig.from_preset(
        "staged", staged_headroom=experts - k))

    prompts = load_prompts(PROMPTS, 2)  # the benchmark's (`ssdmoe bench`)
    inline = engine.readers.INLINE_WARM_BYTES

    def run(model, tok, runtime=None, inline_bytes: int = inline) -> float:
        engine.readers.INLINE_WARM_BYTES = inline_bytes
        steps, seconds = 0, 0.0
        for p in prompts:
            r = generate(model, tok, p, args.tokens, stop_at_eos=False, runtime=runtime)
            steps += sum(1 for s in r.steps if s["phase"] == "decode")
            seconds += r.decode_s
        return steps / seconds

    arms = {"engine-resident": lambda: run(resident, rtok),
            "staged": lambda: run(staged.model, staged.tokenizer, staged.runtime),
            "staged-readers": lambda: run(staged.model, staged.tokenizer, staged.runtime,
                                          inline_bytes=0),
            "staged-all-hit": lambda: run(all_hit.model, all_hit.tokenizer, all_hit.runtime)}
    for arm in arms.values():  # warm-up: JIT kernels, fill slots
        arm()
        arm()
    rounds: dict[str, list[float]] = {a: [] for a in arms}
    names = list(arms)
    for r in range(args.rounds):
        for a in names[r % len(names):] + names[:r % len(names)]:
            rounds[a].append(arms[a]())
    loads = {}
    engine.readers.INLINE_WARM_BYTES = inline
    for name, loaded in {"staged": staged, "staged-all-hit": all_hit}.items():
        rows: list[dict] = []
        loaded.store.on_load = rows.append
        n_loads = n_steps = 0
        for p in prompts:
            rows.clear()
            r = loaded.generate(p, args.tokens, stop_at_eos=False)
            decode = {s["step"] for s in r.steps if s["phase"] == "decode"}
            n_loads += sum(1 for x in rows if x["step"] in decode)
            n_steps += len(decode)
        loads[name] = n_loads / max(n_steps, 1)
    loads["staged-readers"] = loads["staged"]  # same model, routing and slots: same reads
    base = rounds["engine-resident"]
    print(f"{args.model}: {args.tokens} tokens, {args.rounds} rounds, one process")
    print("| arm | decode tok/s (median) | vs engine-resident | paired | loads/step |")
    print("|---|---|---|---|---|")
    out = []
    for a, v in rounds.items():
        med = statistics.median(v)
        paired = statistics.median(x / b for x, b in zip(v, base, strict=True))
        ratio = med / statistics.median(base)
        print(f"| {a} | {med:.1f} | {ratio:.2f}x | {paired:.2f}x | {loads.get(a, 0.0):.1f} |")
        out.append({"arm": a, "decode_tok_s": med, "vs_engine_resident": ratio,
                    "paired": paired, "loads_per_step": loads.get(a, 0.0), "rounds": v})
    OUT.write_text(json.dumps({"command": "uv run python reports/bench/fill_cost.py",
                               "model": args.model, "tokens": args.tokens,
                               "loadavg": os.getloadavg(), "arms": out}, indent=1) + "\n")
    print(f"wrote {OUT}")
    for loaded in (staged, all_hit):
        loaded.close()


if __name__ == "__main__":
    main()
