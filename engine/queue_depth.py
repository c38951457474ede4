"""How many reads the engine keeps in flight (its reader threads) when not told: the model
directory's `queue_depth.json`, written by `ssdmoe calibrate --model DIR` from the device's
throughput against queue depth measured with this model's own read size (one bundle), else
contract.engine_config.DEFAULT_READERS, saying it was not measured. No MLX."""

from __future__ import annotations

import json
from pathlib import Path

from contract.engine_config import DEFAULT_READERS, MAX_READERS
from contract.errors import BadInput

FILE = "queue_depth.json"
KNEE = 0.9  # the fewest reads in flight reaching this share of the best throughput


def choose(curve: dict[int, float]) -> int:
    """The fewest reads in flight whose throughput reaches KNEE of the curve's best."""
    if not curve:
        raise ValueError("empty queue-depth curve")
    best = max(curve.values())
    return min(n for n, v in curve.items() if v >= KNEE * best)


def write(model_dir: Path, curve: dict[int, float], read_bytes: int, how: str) -> Path:
    """Record the measured curve and the count chosen from it beside the model."""
    path = Path(model_dir) / FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({
        "readers": choose(curve), "read_bytes": int(read_bytes),
        "gbps_by_depth": {str(n): round(v, 4) for n, v in sorted(curve.items())},
        "rule": f"fewest reads in flight reaching {KNEE:.0%} of the best throughput",
        "how": how}, indent=1) + "\n")
    tmp.replace(path)
    return path


def default_readers(model_dir: Path, bundle_bytes: int) -> tuple[int, str]:
    """(reads in flight, where that came from) for a model directory."""
    path = Path(model_dir) / FILE
    if not path.is_file():
        return DEFAULT_READERS, (f"default {DEFAULT_READERS}: no {FILE} (not measured: ssdmoe "
                                 "calibrate --queue-depth-only --model DIR measures it)")
    try:
        d = json.loads(path.read_text())
        n, read_bytes = d["readers"], int(d["read_bytes"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise BadInput(f"{path}: not a queue-depth record ({type(err).__name__}: {err})") \
            from None
    if not isinstance(n, int) or not 1 <= n <= MAX_READERS:
        raise BadInput(f"{path}: readers must be an integer from 1 to {MAX_READERS}, got {n!r}")
    if read_bytes != bundle_bytes:
        return DEFAULT_READERS, (f"default {DEFAULT_READERS}: {path} was measured with "
                                 f"{read_bytes}-byte reads, this model's bundle is "
                                 f"{bundle_bytes} bytes (re-run calibrate)")
    return n, f"{path}: {d.get('rule', 'measured')}"
