import json
from traces.reader import read_trace
from traces.summary import summarize
out = {}
for name in ["on-demand-pc25-15mbps", "on-demand-pc25-unthrottled"]:
    rows = []
    for r in range(3):
        t = read_trace(f"/tmp/recap/{name}.r{r}")
        s = summarize(t)
        rows.append({"round": r, "decode_tok_s": s["decode_tok_s"], "cold_fraction": s.get("cold_fraction"),
                     "method": (t.run.get("engine") or {}).get("residency_method")})
    old = []
    for suf in ["", ".r1", ".r2"]:
        t = read_trace(f"reports/validation/traces/{name}{suf}")
        s = summarize(t); old.append((round(s["decode_tok_s"], 2), round(s.get("cold_fraction") or -1, 3)))
    sim = json.load(open(f"reports/validation/results/{name}.json"))["simulated"]
    out[name] = {"new_rounds": rows, "old_rounds_tok_s_cold": old, "simulated_cold_fraction": sim.get("cold_fraction"),
                 "simulated_decode_tok_s": sim.get("decode_tok_s")}
print(json.dumps(out, indent=1))
