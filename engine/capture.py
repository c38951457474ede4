"""The capture loop: several prompts, each prefill + decode, one trace (`request` = prompt index,
`step` global across prompts). Plus the pieces `ssdmoe capture` and `ssdmoe generate --trace`
share: reading a prompts file, preparing an output directory, starting a recorder."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contract.errors import BadInput
from engine.engine import Engine
from engine.generate import GenerationResult
from engine.recorder import Recorder, engine_info, run_info
from traces.schema import RUN_FILE

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "traces" / "prompts" / "default.jsonl"
def read_prompts(path: str | Path) -> list[str]:
    """A JSON-lines file, one object per line with a non-empty string "prompt" (blank lines
    are skipped). Errors name file:line."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"{path}: prompts file not found")
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise BadInput(f"{path}: cannot read ({err})") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise BadInput(f"{path}:{n}: not valid JSON ({err.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise BadInput(f"{path}:{n}: expected an object with a string \"prompt\"")
        if not obj["prompt"]:
            raise BadInput(f"{path}:{n}: empty prompt")
        prompts.append(obj["prompt"])
    if not prompts:
        raise BadInput(f"{path}: no prompts")
    return prompts


def prepare_out_dir(path: str | Path, force: bool, what: str = "--out") -> Path:
    """An empty (or new) directory for a trace. A non-empty one is refused unless `force` and it
    holds a trace (run.json), which is then removed; never deletes anything else."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise BadInput(f"{path}: exists and is not a directory ({what})")
        if any(path.iterdir()):
            if not force:
                raise BadInput(f"{path}: exists and is not empty (use --force to replace it)")
            if not (path / RUN_FILE).is_file():
                raise BadInput(f"{path}: not empty and not a trace (no {RUN_FILE}); refusing to "
                               "replace it")
            shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def expert_bytes(manifest) -> int:
    return sum(e.bundle_bytes for e in manifest.layers.values()) * manifest.num_experts


def load_engine(
    model_dir: str | Path,
    *,
    preset: str = "on-demand",
    o_direct: bool = False,
    page_cache_mb: float | None = None,
    page_cache_fraction: float | None = None,
    verify: bool | None = None,
    lookahead: bool = True,
    prerouter: str | Path | None = None,
    lead: str = "none",
    top_k: int | None = None,
    lora: str | Path | None = None,
    readers: int | None = None,
    hot_mb: float | None = None,
    cache_policy: str | None = None,
    staged_headroom: int | None = None,
    first_layer_hint: bool = False,
    native_reads: bool = False,
):
    """-> the Engine (engine.engine) for `preset`
    (contract.engine_config.PRESETS) with the page-cache budget given in MiB or as a fraction of the
    model's expert bytes, and the hot path's LRU in MiB (None: the config's default)."""
    from contract.engine_config import EngineConfig
    from engine.loader import load_streaming, open_manifest

    budget = None
    if page_cache_mb is not None:
        budget = int(page_cache_mb * 2**20)
    elif page_cache_fraction is not None:
        budget = int(page_cache_fraction * expert_bytes(open_manifest(model_dir, verify=False)))
    if prerouter is not None and lead == "none":
        lead = "token"
    config = EngineConfig.from_preset(preset, o_direct=o_direct, page_cache_budget=budget,
                                      lookahead=lookahead, lead_kind=lead, top_k=top_k,
                                      readers=readers, cache_policy=cache_policy,
                                      hot_bytes=None if hot_mb is None else int(hot_mb * 2**20),
                                      staged_headroom=staged_headroom,
                                      prerouter=None if prerouter is None else str(prerouter),
                                      first_layer_hint=first_layer_hint,
                                      native_reads=native_reads,
                                      lora=None if lora is None else str(lora))
    return load_streaming(model_dir, verify=verify, config=config)


def start_recorder(out: Path, engine: Engine, *, extra: dict[str, Any] | None = None,
                   command: list[str] | None = None, **recorder_opts: Any) -> Recorder:
    """A recorder writing to `out`, run.json filled from the engine, attached."""
    run = run_info(engine.manifest, engine_info(engine), extra=extra,
                   command=list(sys.argv) if command is None else command)
    return Recorder(out, run, **recorder_opts).attach(engine)


def capture(
    engine: Engine,
    prompts: list[str],
    max_tokens: int,
    *,
    recorder: Recorder | None = None,
    temp: float = 0.0,
    seed: int = 0,
    prefill_step_size: int = 2048,
    stop_at_eos: bool = False,
    on_step: Callable[[dict], None] | None = None,
    step0: int = 0,
    request0: int = 0,
) -> list[GenerationResult]:
    """Each prompt: prefill, then decode `max_tokens` tokens (fewer only if `stop_at_eos`).
    `request` = request0 + prompt index; steps are numbered across prompts from `step0`.
    `on_step` sees every step row (after the recorder)."""
    hooks: dict[str, Any] = recorder.hooks() if recorder is not None else {}
    if on_step is not None:
        rec_step = hooks.get("on_step")

        def both(row: dict) -> None:
            if rec_step is not None:
                rec_step(row)
            on_step(row)

        hooks["on_step"] = both
    results = []
    for i, prompt in enumerate(prompts):
        result = engine.generate(prompt, max_tokens, temp=temp, seed=seed,
                                 prefill_step_size=prefill_step_size, stop_at_eos=stop_at_eos,
                                 request=request0 + i, step0=step0, **hooks)
        step0 += len(result.steps)
        results.append(result)
    return results


def decode_tok_s(results: list[GenerationResult]) -> float:
    """Decode tokens per second over several generations (decode steps / decode wall time)."""
    steps = sum(1 for r in results for s in r.steps if s["phase"] == "decode")
    seconds = sum(r.decode_s for r in results)
    return steps / seconds if seconds > 0 else 0.0
