"""Prefill, then decode, one forward step at a time, with per-step hooks.

The math follows mlx-lm's `generate_step` (prompt[:-1] prefilled in chunks of
`prefill_step_size`, the last prompt token's step yields the first token, logprobs =
logits - logsumexp, mlx-lm samplers), so greedy tokens equal `mlx_lm.generate`'s on the same
model. Unlike `generate_step` it does not overlap step t+1's graph building with step t's
evaluation: each step is timed on its own, which is what a trace needs.

Hooks (the trace recorder plugs in here):
  on_step_start(step, phase, tokens)  before a forward step is built
  on_step(row)                        after it is evaluated; row = {"step", "request", "phase",
                                      "tokens", "start_ns", "build_ns", "eval_ns", "end_ns"}
  on_text(segment)                    streamed text as tokens are decoded
`store.step` (if a store is given) is set to the step number so load rows carry it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

StepStart = Callable[[int, str, int], None]
StepEnd = Callable[[dict], None]


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    prefill_tok_s: float
    decode_tok_s: float
    finish_reason: str  # "length" | "stop"
    steps: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        return {"tokens": self.tokens, "text": self.text, "prefill_tok_s": self.prefill_tok_s,
                "decode_tok_s": self.decode_tok_s}


def generate(
    model,
    tokenizer,
    prompt: str | list[int],
    max_tokens: int = 64,
    *,
    temp: float = 0.0,
    seed: int | None = None,
    prefill_step_size: int = 2048,
    stop_at_eos: bool = True,
    store=None,
    request: int = 0,
    step0: int = 0,
    on_text: Callable[[str], None] | None = None,
    on_step_start: StepStart | None = None,
    on_step: StepEnd | None = None,
) -> GenerationResult:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise ValueError("empty prompt")
    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(temp)
    cache = make_prompt_cache(model)
    steps: list[dict] = []
    counter = [step0]

    def forward(tokens: list[int], phase: str, sample: bool):
        step = counter[0]
        counter[0] += 1
        if store is not None:
            store.step = step
        if on_step_start is not None:
            on_step_start(step, phase, len(tokens))
        start = time.perf_counter_ns()
        logits = model(mx.array(tokens)[None], cache=cache)
        if sample:
            logits = logits[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            out = sampler(logprobs)
            built = time.perf_counter_ns()
            mx.eval(out)
        else:
            out = None
            built = time.perf_counter_ns()
            mx.eval([c.state for c in cache])
        end = time.perf_counter_ns()
        row = {"step": step, "request": request, "phase": phase, "tokens": len(tokens),
               "start_ns": start, "build_ns": built - start, "eval_ns": end - built,
               "end_ns": end}
        steps.append(row)
        if on_step is not None:
            on_step(row)
        return None if out is None else int(out.item())

    # Prefill: all prompt tokens but the last in chunks, then the last one yields token 0.
    t0 = time.perf_counter()
    rest = ids
    while len(rest) > 1:
        n = min(prefill_step_size, len(rest) - 1)
        forward(rest[:n], "prefill", sample=False)
        rest = rest[n:]
    token = forward(rest, "prefill", sample=True)
    t1 = time.perf_counter()

    detok = tokenizer.detokenizer
    detok.reset()
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    out: list[int] = []
    finish = "length"
    while True:
        if stop_at_eos and token in eos:
            finish = "stop"
            break
        out.append(token)
        detok.add_token(token)
        _emit(detok, on_text)
        if len(out) >= max_tokens:
            break
        token = forward([token], "decode", sample=True)
    t2 = time.perf_counter()
    detok.finalize()
    _emit(detok, on_text)

    decode_steps = sum(1 for s in steps if s["phase"] == "decode")
    prefill_s, decode_s = t1 - t0, t2 - t1
    return GenerationResult(
        tokens=out, text=detok.text, prompt_tokens=len(ids), prefill_s=prefill_s,
        decode_s=decode_s, prefill_tok_s=len(ids) / prefill_s if prefill_s > 0 else 0.0,
        decode_tok_s=decode_steps / decode_s if decode_s > 0 and decode_steps else 0.0,
        finish_reason=finish, steps=steps,
    )


def _emit(detok, on_text) -> None:
    if on_text is not None:
        segment = detok.last_segment  # reading it consumes it
        if segment:
            on_text(segment)
