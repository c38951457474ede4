"""`ssdmoe advise` on the paper's machines: `uv run python reports/advise/paper.py`.

For the MacBook M2 16 GB and the Mac mini M4 Pro 24 GB profiles (scenarios/hardware, built
from the paper's component figures) with the 35B model profile: advise searches this
project's engine (its paths, leads, caches and reads in flight, with the paper's routing
statistics: overlap 0.25, skew 2.35) and its recommendation is put beside the paper's own
configuration as the paper scenarios describe it (scenarios/paper-*.toml: the paper's engine,
staged with the token lead, a 803 MB bundle LRU, the stager's synchronous fill, K=4), both
simulated for the same 1,000 decode steps. Writes reports/advise/paper/MACHINE/advise.json,
reports/advise/paper.json and prints the table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MACHINES = {"m2-16gb": "paper-m2-16gb", "m4pro-24gb": "paper-m4pro-24gb"}
ROUTING = ["--set", "overlap=0.25", "--set", "skew=2.35"]  # the paper scenarios' routing
STEPS = "1000"


def ssdmoe(*args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "ssdmoe_cli", *args], cwd=ROOT,
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"ssdmoe {' '.join(args)}: {(p.stderr or p.stdout).strip().splitlines()[-1]}")
    return p.stdout


def main() -> None:
    rows = []
    for hardware, paper in MACHINES.items():
        out = ROOT / "reports" / "advise" / "paper" / hardware
        cmd = ["advise", "edge0-35b", "--hardware", hardware, "--k", "4", "--k", "8",
               "--decode-steps", STEPS, *ROUTING, "--out", str(out.relative_to(ROOT))]
        print(ssdmoe(*cmd), flush=True)
        advice = json.loads((out / "advise.json").read_text())
        rec = advice["recommended"]
        theirs = json.loads(ssdmoe("sim", "run", paper, "--json"))
        on_demand = json.loads(ssdmoe("sim", "run", paper, "--set", "lead=none", "--json"))
        rows.append({
            "hardware": hardware, "advise_command": "ssdmoe " + " ".join(cmd),
            "recommended": rec["label"], "why": rec["why"],
            "recommended_decode_tok_s": rec["predicted"]["decode_tok_s"],
            "recommended_engine_bytes": rec["predicted"]["peak_engine_bytes"],
            "recommended_page_cache_bytes": rec["predicted"]["page_cache_bytes"],
            "paper_config": f"scenarios/{paper}.toml (prerouter, K=4)",
            "paper_decode_tok_s": theirs["decode_tok_s"],
            "paper_engine_bytes": theirs["peak_engine_bytes"],
            "paper_page_cache_bytes": theirs["page_cache_bytes"],
            "paper_on_demand_decode_tok_s": on_demand["decode_tok_s"],
            "search": advice["search"], "wall_s": advice["wall_s"]})
    (ROOT / "reports" / "advise" / "paper.json").write_text(json.dumps(rows, indent=1) + "\n")
    gib = 2**30
    print("| machine | advise recommends | predicted tok/s | engine GiB | the paper's config "
          "| predicted tok/s | engine GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['hardware']} | {r['recommended']} | {r['recommended_decode_tok_s']:.2f} | "
              f"{r['recommended_engine_bytes'] / gib:.2f} | prerouter, K=4, 803 MB LRU | "
              f"{r['paper_decode_tok_s']:.2f} | {r['paper_engine_bytes'] / gib:.2f} |")


if __name__ == "__main__":
    main()
