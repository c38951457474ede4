"""Display names of the compared metrics, shared by the report's text and figures."""

from __future__ import annotations

LABELS = {"decode_tok_s": "decode tok/s", "step_ms_p50": "step p50 ms",
          "blocked_ms_per_step": "blocked ms/step", "cold_fraction": "cold fraction",
          "build_ms_per_step": "build ms/step", "eval_ms_per_step": "eval ms/step"}
