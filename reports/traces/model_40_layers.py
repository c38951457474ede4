"""Build the trace-overhead model: qwen3_moe with the 35B's routing shape (40 layers, 256
experts, K=8) at fixture width (hidden 128, expert width 64), random weights, seed 0, converted
to the streaming layout. Its decode step (~55 ms here) is close to the 35B's on the paper's
M4 Pro (~50 ms at 20 tok/s), so the recorder's per-step work weighs about as it would there.

    uv run python reports/traces/model_40_layers.py [OUT]    # default models/qwen3-40x256-k8
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.convert import convert  # noqa: E402
from engine.fixtures.random_models import build_random, small_config  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "models/qwen3-40x256-k8"
    cfg = small_config("qwen3_moe")
    cfg.update(num_hidden_layers=40, num_experts=256, num_experts_per_tok=8,
               moe_intermediate_size=64)
    src = build_random("qwen3_moe", out.with_name(out.name + "-src"), 0, cfg)
    convert(src, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
