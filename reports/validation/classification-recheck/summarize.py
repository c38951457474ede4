"""Cold fraction and decode tok/s of the re-captured rounds (run.sh) beside the committed
validation traces and the simulator's prediction. OUT: run.sh's trace folder."""

import json
import os

from traces.reader import read_trace
from traces.summary import summarize

OUT = os.environ.get("OUT", "/tmp/recap")
CONFIGS = ("on-demand-pc25-15mbps", "on-demand-pc25-unthrottled")


def main() -> None:
    out = {}
    for name in CONFIGS:
        rows = []
        for r in range(3):
            s = summarize(read_trace(f"{OUT}/{name}.r{r}"))
            rows.append({"round": r, "decode_tok_s": s["decode_tok_s"],
                         "cold_fraction": s.get("cold_fraction")})
        old = []
        for suffix in ("", ".r1", ".r2"):
            s = summarize(read_trace(f"reports/validation/traces/{name}{suffix}"))
            old.append((round(s["decode_tok_s"], 2), round(s.get("cold_fraction") or -1, 3)))
        with open(f"reports/validation/results/{name}.json") as fh:
            sim = json.load(fh)["simulated"]
        out[name] = {"new_rounds": rows, "old_rounds_tok_s_cold": old,
                     "simulated_cold_fraction": sim.get("cold_fraction"),
                     "simulated_decode_tok_s": sim.get("decode_tok_s")}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
