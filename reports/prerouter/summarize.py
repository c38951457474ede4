"""Write reports/prerouter/current.md from a model's trained heads: what `ssdmoe train heads`
recorded in prerouter.json (`report`), with the manifest sha the heads were trained on.

    uv run python reports/prerouter/summarize.py models/tiny-trained-stream
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.manifest import MANIFEST_FILE, sha256_file  # noqa: E402

OUT = Path(__file__).resolve().parent / "current.md"


def report(model: Path) -> str:
    meta = json.loads((model / "prerouter" / "prerouter.json").read_text())
    r = meta["report"]
    sha = sha256_file(model / MANIFEST_FILE)
    before, after, lm = r["heldout_before"], r["heldout"], r["lm_heldout"]
    rows = ["| head (owner -> consumer) | trained head | reuse (the consumer's set at t) | "
            "warm start (next router on this state) |", "|---|---|---|---|"]
    for h in after["per_head"]:
        rows.append(f"| {h['owner']} -> {h['consumer']} | {h['head_recall']:.3f} | "
                    f"{h['reuse_recall']:.3f} | {h['warm_start_recall']:.3f} |")
    rows.append(f"| **mean** | **{after['head_recall_mean']:.3f}** | "
                f"{after['reuse_recall_mean']:.3f} | {after['warm_start_recall_mean']:.3f} |")
    cfg = r["config"]
    return "\n".join([
        "# Prerouter heads on the committed tiny-trained build",
        "",
        f"Written by `uv run python reports/prerouter/summarize.py {model}` from the heads' "
        f"`prerouter.json`, trained by `uv run ssdmoe train heads {model}` on manifest sha256 "
        f"`{sha}` ({cfg['steps']} steps of {cfg['batch']} rows per head, "
        f"{r['train_rows_per_head']} training rows, {r['heldout_rows_per_head']} held-out rows "
        f"per head; recording {r['record_s']:.0f} s, training {r['train_s']:.0f} s).",
        "",
        "Held-out recall of the next token's true top-K at the next layer:",
        "",
        *rows,
        "",
        f"Mean KL: {before['kl_mean']:.2f} at the warm start, {after['kl_mean']:.2f} after "
        "training.",
        f"Used as the routing, held-out cross-entropy {lm['ce_base']:.3f} (own routing) -> "
        f"{lm['ce_prerouted']:.3f} (predicted, {lm['ce_prerouted'] / lm['ce_base'] - 1:+.1%}); "
        f"greedy next tokens agree on {lm['greedy_agreement']:.1%} of {lm['windows']} windows' "
        "positions.",
        "",
    ])


def main() -> None:
    model = Path(sys.argv[1] if len(sys.argv) > 1 else "models/tiny-trained-stream")
    try:
        text = report(model)
    except (OSError, KeyError, ValueError) as err:  # one line, no traceback
        sys.exit(f"{model}: not a converted model with trained heads (prerouter/prerouter.json): "
                 f"{type(err).__name__}: {err}")
    OUT.write_text(text)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
