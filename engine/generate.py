"""Prefill, then decode, one forward step at a time, with per-step hooks.

The math follows mlx-lm's `generate_step` (prompt[:-1] prefilled in chunks of
`prefill_step_size`, the last prompt token's step yields the first token, logprobs =
logits - logsumexp, mlx-lm samplers, mlx-lm's generation stream), so greedy tokens equal
`mlx_lm.generate`'s on the same model.

Lookahead (as `generate_step`): while step t evaluates, step t+1's graph is built from step
t's still-lazy token, so graph building hides behind compute. Step t's evaluation is queued
as soon as its graph is built; while step t+1 is built, step t's fill points are resolved
one per staged layer (engine.fill_points: on-demand staged layers bring their routed ids to
the host and fill their slots, in layer order, during evaluation); then step t+1's
evaluation is queued and only then does token t come to the host, so the host work between
tokens (hooks, detokenizing, the trace) overlaps compute.
It is on unless the config turns it off (`EngineConfig.lookahead`) or a decode layer syncs at
build time (exact: building step t+1 would wait for step t anyway; such a sync would also
evaluate earlier layers before their fill points, so then no path defers at all). Stopping at EOS
drops the step built ahead (its staging is reset; its step number is reused).

Step rows (what a trace records): with lookahead the steps' work overlaps, so each row is a
WINDOW of wall time, [end of the previous sampled step, this step's token on the host], and
the windows tile the decode phase (sum of windows = decode wall time). `build_ns` is the graph
building inside the window (step t+1's graph, built while step t computes); `eval_ns` the
rest. Without lookahead a row is [build start, token on host] and its build is its own.

Hooks (the trace recorder plugs in here):
  on_step_start(step, phase, tokens)  before a forward step is built (with lookahead: while
                                      the previous step still computes)
  on_step(row)                        after its token is on the host; row = {"step",
                                      "request", "phase", "tokens", "start_ns", "build_ns",
                                      "eval_ns", "end_ns", "build_spans"} (build_spans: the
                                      [start, end) ns intervals of graph building inside the
                                      window; not a trace column)
  on_text(segment)                    streamed text as tokens are decoded
  on_token(id, logprob, top)          each emitted token (logprob None unless asked for)
  stop_check()                        after each token's text: a finish reason ("stop" for a
                                      stop sequence, "cancelled" for a client gone) ends the
                                      request there, else None
Sampling is mlx-lm's (`make_sampler`: temperature, top_p, top_k). With `logprobs` (the number
of alternatives, 0 for none) on_token gets each token's log-probability and the top ones.
With a prerouter (runtime.preroute) its state is reset at the start: a new sequence.
The runtime's step clock (engine.step_clock) holds the step whose loads are being done, so
load rows carry it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from engine.fill_points import FillPoints, resolve

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
    finish_reason: str  # "length" | "stop" | what stop_check returned
    steps: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        return {"tokens": self.tokens, "text": self.text, "prefill_tok_s": self.prefill_tok_s,
                "decode_tok_s": self.decode_tok_s}


@dataclass
class _Built:
    """A forward step whose graph is built but not evaluated."""
    step: int
    phase: str
    tokens: int
    out: mx.array | None  # sampled token [1], or None for a prefill chunk
    lp: mx.array | None  # log-probabilities [1, V] it was sampled from (when asked for)
    points: list  # its fill points (engine.fill_points)
    span: tuple[int, int]  # graph building, perf_counter_ns
    also: list = field(default_factory=list)  # side outputs evaluated with `out` (predictions)
    begun: bool = False  # its evaluation is queued (FillPoints.begin)


def generate(
    model,
    tokenizer,
    prompt: str | list[int],
    max_tokens: int = 64,
    *,
    temp: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    logprobs: int | None = None,
    stop_check: Callable[[], str | None] | None = None,
    on_token: Callable[[int, float | None, list], None] | None = None,
    prefill_step_size: int = 2048,
    stop_at_eos: bool = True,
    store=None,
    request: int = 0,
    step0: int = 0,
    lookahead: bool | None = None,
    on_text: Callable[[str], None] | None = None,
    on_step_start: StepStart | None = None,
    on_step: StepEnd | None = None,
) -> GenerationResult:
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise ValueError("empty prompt")
    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(temp, top_p=top_p, top_k=top_k)
    cache = make_prompt_cache(model)
    runtime = getattr(store, "runtime", None)
    fills = runtime.fills if runtime is not None else FillPoints()
    clock = fills.clock  # the step every load is labelled with (engine.step_clock)
    if lookahead is None:
        lookahead = runtime.config.lookahead if runtime is not None else True
    # Fill points only when no single-token layer syncs while the graph is built: such a
    # sync would evaluate the layers before it, fill points not yet resolved included.
    deferring = runtime is None or not runtime.syncs_at_build("decode")
    lookahead = lookahead and deferring
    preroute = getattr(runtime, "preroute", None)
    if preroute is not None:  # a new sequence: no previous token, nothing predicted
        preroute.reset()
    steps: list[dict] = []
    counter = [step0]

    def build(tokens: mx.array, phase: str, sample: bool) -> _Built:
        step = counter[0]
        counter[0] += 1
        clock.step = step
        if on_step_start is not None:
            on_step_start(step, phase, tokens.size)
        b0 = time.perf_counter_ns()
        if deferring:
            with fills.collecting():
                logits = model(tokens[None], cache=cache)
        else:
            logits = model(tokens[None], cache=cache)
        out = lp = None
        if sample:
            logits = logits[:, -1, :]
            lp = logits - mx.logsumexp(logits, keepdims=True)
            out = sampler(lp)
        # The prerouter's predictions for the next call are side outputs of this step: queued
        # with it, so they are ready when the next step's staging asks for them as it begins.
        also = list(preroute.pending().values()) if preroute is not None and sample else []
        return _Built(step, phase, tokens.size, out, lp if logprobs is not None else None,
                      fills.take(), (b0, time.perf_counter_ns()), also)

    def record(b: _Built, start: int, spans: list[tuple[int, int]], end: int) -> None:
        spans = [(max(a, start), min(z, end)) for a, z in spans if z > start and a < end]
        build_ns = sum(z - a for a, z in spans)
        row = {"step": b.step, "request": request, "phase": b.phase, "tokens": b.tokens,
               "start_ns": start, "build_ns": build_ns, "eval_ns": end - start - build_ns,
               "end_ns": end, "build_spans": spans}
        steps.append(row)
        if on_step is not None:
            on_step(row)

    def run_chunk(tokens: list[int]) -> None:  # a prefill chunk: no token sampled
        b = build(mx.array(tokens), "prefill", sample=False)
        resolve(b.points, clock)
        mx.eval([c.state for c in cache])
        record(b, b.span[0], [b.span], time.perf_counter_ns())

    def finish(b: _Built, start: int, spans: list, want_next: bool
               ) -> tuple[int, _Built | None, float | None, list]:
        """Evaluate `b`, resolving its fill points; when looking ahead, build the next decode
        step and queue its evaluation before `b`'s token comes to the host, so the host work
        between tokens overlaps compute. Records `b`'s window from `start`. Returns (token,
        the next step or None, its log-probability and top alternatives when asked for)."""
        nxt = None
        clock.step = b.step
        if not b.begun:
            fills.begin(b.points, [*b.also, b.out] if b.also else b.out)
        if lookahead and want_next:
            fills.overlapping = True
            fills.busy = []
            nxt = build(b.out, "decode", sample=True)  # resolves b's fill points as it goes
            fills.drain()
            spans = spans + _minus(nxt.span, fills.busy)
            fills.begin(nxt.points, [*nxt.also, nxt.out] if nxt.also else nxt.out)
            nxt.begun = True
        else:
            fills.drain()
        token = int(b.out.item())
        chosen, top = None, []
        if b.lp is not None:
            row = np.array(b.lp[0])
            chosen = float(row[token])
            best = np.argpartition(-row, logprobs - 1)[:logprobs] if logprobs else []
            top = sorted(((int(i), float(row[i])) for i in best), key=lambda t: -t[1])
        fills.overlapping = False
        record(b, start, spans, time.perf_counter_ns())
        return token, nxt, chosen, top

    def abandon(b: _Built) -> None:
        """A step built ahead that will not run (EOS): drop its staging, reuse its number."""
        counter[0] = b.step
        fills.abort()  # its fill points never run: only its first router was queued
        if runtime is not None:
            runtime.reset()

    out: list[int] = []
    detok = tokenizer.detokenizer
    detok.reset()
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])

    def run() -> tuple[float, float, str]:
        # Prefill: all prompt tokens but the last in chunks, then the last one yields token 0.
        t0 = time.perf_counter()
        rest = ids
        while len(rest) > 1:
            n = min(prefill_step_size, len(rest) - 1)
            run_chunk(rest[:n])
            rest = rest[n:]
        b = build(mx.array(rest), "prefill", sample=True)
        token, nxt, chosen, top = finish(b, b.span[0], [b.span], want_next=max_tokens > 1)
        t1 = time.perf_counter()
        while True:
            if stop_at_eos and token in eos:
                if nxt is not None:
                    abandon(nxt)
                return t0, t1, "stop"
            out.append(token)
            if on_token is not None:
                on_token(token, chosen, top)
            detok.add_token(token)
            _emit(detok, on_text)
            reason = stop_check() if stop_check is not None else None
            if reason is not None:
                if nxt is not None:
                    abandon(nxt)
                return t0, t1, reason
            if len(out) >= max_tokens:
                return t0, t1, "length"
            if nxt is None:  # no lookahead: build this step now, inside its own window
                nxt = build(mx.array([token]), "decode", sample=True)
                start, spans = nxt.span[0], [nxt.span]
            else:  # built during the previous window
                start, spans = steps[-1]["end_ns"], []
            token, nxt, chosen, top = finish(nxt, start, spans,
                                             want_next=len(out) + 1 < max_tokens)

    try:
        with mx.stream(generation_stream):
            t0, t1, finish_reason = run()
    except BaseException:
        fills.abort()
        if runtime is not None:
            runtime.reset()
        raise
    t2 = time.perf_counter()
    detok.finalize()
    _emit(detok, on_text)

    decode_steps = sum(1 for s in steps if s["phase"] == "decode")
    prefill_s, decode_s = t1 - t0, t2 - t1
    return GenerationResult(
        tokens=out, text=detok.text, prompt_tokens=len(ids), prefill_s=prefill_s,
        decode_s=decode_s, prefill_tok_s=len(ids) / prefill_s if prefill_s > 0 else 0.0,
        decode_tok_s=decode_steps / decode_s if decode_s > 0 and decode_steps else 0.0,
        finish_reason=finish_reason, steps=steps,
    )


def _emit(detok, on_text) -> None:
    if on_text is not None:
        segment = detok.last_segment  # reading it consumes it
        if segment:
            on_text(segment)


def _minus(span: tuple[int, int], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`span` with the sorted, disjoint `holes` cut out."""
    out, a = [], span[0]
    for h0, h1 in holes:
        if h1 <= a or h0 >= span[1]:
            continue
        if h0 > a:
            out.append((a, h0))
        a = max(a, h1)
    if a < span[1]:
        out.append((a, span[1]))
    return out
