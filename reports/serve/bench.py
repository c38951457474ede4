"""Serving overhead: time to first token and decode tok/s through the HTTP API (`ssdmoe serve`,
streamed completions read by httpx) against the engine's own `generate` (what `ssdmoe
generate` runs) on the same model, preset, prompts, sampling and seeds.

    uv run python reports/serve/bench.py [--model models/tiny-trained-stream] [--rounds 5]

Both arms are warm, long-lived processes started once (the server, and a direct worker that
loads the engine the same way and runs `engine.generate`; neither preloads OpenBLAS, as neither
`ssdmoe serve` nor `ssdmoe generate` does); each round runs every prompt in both
arms, arm order alternating by round. Decode tok/s is (completion tokens - 1) / (time from the
first token to the last); TTFT is from sending the request (or calling generate) to the first
token. Prints a table and writes reports/serve/bench.json and README.md (medians and the paired
per-round ratio http / direct)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

DIRECT = """
import json, sys, time
from pathlib import Path
from ssdmoe_cli.serve_cmd import load_served
engine = load_served(Path(sys.argv[1]), sys.argv[2], None, True, None, True, None)
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    first = []
    t0 = time.perf_counter()
    r = engine.generate(req["prompt"], req["n"], temp=req["temp"], seed=req["seed"],
                        on_token=lambda *a: first or first.append(time.perf_counter()))
    t2 = time.perf_counter()
    print(json.dumps({"ttft_s": first[0] - t0, "decode_s": t2 - first[0],
                      "tokens": len(r.tokens), "text": r.text}), flush=True)
"""


def http_run(url: str, model_id: str, prompt: str, n: int, temp: float, seed: int) -> dict:
    import httpx

    t0 = time.perf_counter()
    first, text, usage, engine = None, [], None, None
    with httpx.stream("POST", f"{url}/v1/completions", timeout=600, json={
            "model": model_id, "prompt": prompt, "max_tokens": n, "temperature": temp,
            "seed": seed, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            body = json.loads(line[5:])
            if body.get("usage"):
                usage = body["usage"]
            engine = body.get("ssdmoe") or engine
            for c in body.get("choices", []):
                if c.get("text"):
                    first = first or time.perf_counter()
                    text.append(c["text"])
    t2 = time.perf_counter()
    return {"ttft_s": first - t0, "decode_s": t2 - first,
            "tokens": usage["completion_tokens"], "text": "".join(text),
            "engine_decode_tok_s": engine["decode_tok_s"]}


def main() -> None:
    from serve_helpers import Server

    from engine.capture import DEFAULT_PROMPTS, read_prompts
    from engine.manifest import MANIFEST_FILE, sha256_file

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/tiny-trained-stream")
    ap.add_argument("--preset", default="staged")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temp", type=float, default=1.0)
    args = ap.parse_args()
    model = Path(args.model)
    prompts = read_prompts(DEFAULT_PROMPTS)[:2]
    srv = Server(model, "--preset", args.preset, "--no-prerouter", "--no-lora",
                 "--max-tokens-limit", str(args.max_tokens), "--model-id", "bench")
    direct = subprocess.Popen([sys.executable, "-c", DIRECT, str(model), args.preset],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert direct.stdout.readline().strip() == "ready"

    def run_direct(prompt: str, seed: int) -> dict:
        direct.stdin.write(json.dumps({"prompt": prompt, "n": args.max_tokens,
                                       "temp": args.temp, "seed": seed}) + "\n")
        direct.stdin.flush()
        return json.loads(direct.stdout.readline())

    arms = {"direct": lambda p, s: run_direct(p, s),
            "http": lambda p, s: http_run(srv.url, "bench", p, args.max_tokens, args.temp, s)}
    try:
        for name in arms:  # warm-up: kernels compiled, slots filled; not timed
            arms[name](prompts[0], 999)
        rounds: list[dict] = []
        for r in range(args.rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            row = {"order": order}
            for name in order:
                runs = [arms[name](p, 100 + i) for i, p in enumerate(prompts)]
                steps = sum(x["tokens"] - 1 for x in runs)
                row[name] = {"decode_tok_s": steps / sum(x["decode_s"] for x in runs),
                             "ttft_ms": 1e3 * statistics.median(x["ttft_s"] for x in runs),
                             "texts": [x["text"] for x in runs]}
                if name == "http":  # the engine's own rate inside the server
                    row[name]["engine_decode_tok_s"] = statistics.median(
                        x["engine_decode_tok_s"] for x in runs)
            rounds.append(row)
    finally:
        code, _ = srv.stop()
        direct.stdin.close()
        direct.wait(30)
    same = all(r["http"]["texts"] == r["direct"]["texts"] for r in rounds)
    summary = {name: {"decode_tok_s": statistics.median(r[name]["decode_tok_s"] for r in rounds),
                      "ttft_ms": statistics.median(r[name]["ttft_ms"] for r in rounds)}
               for name in arms}
    ratio = statistics.median(r["http"]["decode_tok_s"] / r["direct"]["decode_tok_s"]
                              for r in rounds)
    inside = statistics.median(r["http"]["engine_decode_tok_s"] / r["direct"]["decode_tok_s"]
                               for r in rounds)
    summary["http"]["engine_decode_tok_s"] = statistics.median(
        r["http"]["engine_decode_tok_s"] for r in rounds)
    overhead = 1 / ratio - 1  # extra decode time per token through HTTP
    cmd = "uv run python reports/serve/bench.py " + " ".join(sys.argv[1:])
    sha = sha256_file(model / MANIFEST_FILE)[:12]
    lines = ["# Serving overhead: HTTP (ssdmoe serve, SSE) vs the engine's generate", "",
             f"`{cmd.strip()}` on {model} (manifest sha {sha}), preset {args.preset}, "
             f"{len(prompts)} prompts x {args.max_tokens} tokens, temperature {args.temp}, "
             f"{args.rounds} rounds, arm order alternating; medians; same texts in both arms: "
             f"{same}.", "",
             "| arm | decode tok/s | TTFT ms |", "|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['decode_tok_s']:.1f} | {s['ttft_ms']:.1f} |")
    lines += ["", f"Paired per-round ratio http / direct decode tok/s: {ratio:.3f}; HTTP adds "
              f"{100 * overhead:.1f}% to decode time per token end to end (target: at most 5%)."
              f" Inside the server the engine decodes at {inside:.3f} of direct (its own "
              f"decode rate, the response's `ssdmoe.decode_tok_s`): the rest is the client's "
              "share of the same two cores and the SSE path."]
    text = "\n".join(lines)
    print(text)
    out = ROOT / "reports" / "serve"
    (out / "README.md").write_text(text + "\n")
    (out / "bench.json").write_text(json.dumps({
        "command": cmd.strip(), "model": str(model), "manifest_sha256": sha,
        "summary": summary, "ratio_http_to_direct": ratio, "overhead": overhead,
        "ratio_engine_inside_server_to_direct": inside,
        "same_texts": same, "server_exit": code,
        "rounds": [{k: ({kk: vv for kk, vv in v.items() if kk != "texts"}
                        if isinstance(v, dict) else v) for k, v in r.items()} for r in rounds]},
        indent=1) + "\n")


if __name__ == "__main__":
    main()
