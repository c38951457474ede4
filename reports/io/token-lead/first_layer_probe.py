"""Could the first MoE layer, which no head predicts, be read ahead? How much of its routed set
at token t+1 a linear map predicts from what is on the host before its router runs.

mlx-lm's own model decodes each prompt of traces/prompts/default.jsonl (sampled, temperature 1,
seed 0), then one forward pass over prompt + continuation gives, for every decoded position,
the first layer's router logits at t+1 and the candidate inputs:

  last layer at t       the last layer's post-attention-norm state at t (what a head owned by
                        the last layer would read)
  embedding of t+1      the sampled token's embedding (on the host with the token, before
                        the first layer's attention runs: a table of token ids would do)
  router on embedding   no fit: the first layer's own router on its norm of the embedding
  previous token's set  the first layer's routed set at t

Each fitted map is ridge regression (lambda 1) onto the router's logits, fitted on the first
3/4 of the positions and scored on the last 1/4: recall = the share of the routed top-K the
map's top-K holds.

Usage: uv run python reports/io/token-lead/first_layer_probe.py [--model models/tiny-trained]
[--tokens 96] [--repeat 4]; writes first-layer-probe.json beside this script."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
PROMPTS = ROOT / "traces" / "prompts" / "default.jsonl"


def recall_at_k(scores: np.ndarray, routed: np.ndarray, k: int) -> float:
    """Mean over rows of |top-k(scores) & top-k(routed)| / k (rows: positions; columns:
    experts; ties broken by the lower index)."""
    got = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    want = np.argsort(-routed, axis=1, kind="stable")[:, :k]
    return float(np.mean([len(set(g) & set(w)) / k for g, w in zip(got, want, strict=True)]))


def ridge(x_fit: np.ndarray, y_fit: np.ndarray, x_test: np.ndarray, lam: float = 1.0
          ) -> np.ndarray:
    """Predictions on x_test of the ridge regression of y on x (with an intercept)."""
    def ones(x):
        return np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)
    a = ones(x_fit)
    w = np.linalg.solve(a.T @ a + lam * np.eye(a.shape[1]), a.T @ y_fit)
    return ones(x_test) @ w


def collect(model_dir: Path, tokens: int, repeat: int) -> dict[str, np.ndarray]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(0)
    try:
        model, tok = load(str(model_dir))
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # cut short, or not mlx-lm's
        raise SystemExit(f"first_layer_probe.py: {model_dir}: cannot be loaded ({e})") from None
    inner = model.model
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()
               if line.strip()] * repeat
    rows: dict[str, list] = {"last": [], "embedding": [], "logits": [], "router_on_embedding": [],
                             "previous": []}
    first = inner.layers[0]
    for prompt in prompts:
        ids = tok.encode(prompt)
        out = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=tokens,
                                                 sampler=make_sampler(temp=1.0))]
        seq = mx.array(ids + out)[None]
        h = emb = inner.embed_tokens(seq)
        states = []
        for layer in inner.layers:
            a = h + layer.self_attn(layer.input_layernorm(h), mask="causal")
            states.append(layer.post_attention_layernorm(a))
            h = a + layer.mlp(states[-1])
        logits = np.array(first.mlp.gate(states[0])[0])
        plain = np.array(first.mlp.gate(first.post_attention_layernorm(emb))[0])
        last, e = np.array(states[-1][0]), np.array(emb[0])
        for t in range(len(ids) - 1, seq.shape[1] - 1):
            rows["last"].append(last[t])
            rows["embedding"].append(e[t + 1])
            rows["logits"].append(logits[t + 1])
            rows["router_on_embedding"].append(plain[t + 1])
            rows["previous"].append(logits[t])
    return {k: np.array(v) for k, v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-trained")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=4)
    args = ap.parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"first_layer_probe.py: {args.model}: not an mlx-lm checkpoint "
                         "(no config.json)")
    if args.tokens < 2 or args.repeat < 1:
        raise SystemExit("first_layer_probe.py: --tokens must be at least 2, --repeat at least 1")
    config = json.loads((args.model / "config.json").read_text())
    k = int(config.get("num_experts_per_tok") or config.get("top_k") or 0)
    if k < 1:
        raise SystemExit(f"first_layer_probe.py: {args.model / 'config.json'}: no experts per "
                         "token (num_experts_per_tok)")
    d = collect(args.model, args.tokens, args.repeat)
    n = len(d["logits"])
    cut = n * 3 // 4
    y = d["logits"]
    test = slice(cut, n)
    out = {
        "last layer at t": recall_at_k(ridge(d["last"][:cut], y[:cut], d["last"][test]),
                                       y[test], k),
        "embedding of t+1": recall_at_k(ridge(d["embedding"][:cut], y[:cut],
                                              d["embedding"][test]), y[test], k),
        "router on embedding": recall_at_k(d["router_on_embedding"][test], y[test], k),
        "previous token's set": recall_at_k(d["previous"][test], y[test], k),
    }
    doc = {"command": "uv run python reports/io/token-lead/first_layer_probe.py "
                      + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": str(args.model),
           "k": k, "positions_fitted": cut, "positions_scored": n - cut, "recall": out}
    (HERE / "first-layer-probe.json").write_text(json.dumps(doc, indent=1) + "\n")
    for name, value in out.items():
        print(f"{name:22s} recall {value:.3f}")
    print(f"({cut} positions fitted, {n - cut} scored, K={k})")


if __name__ == "__main__":
    main()
