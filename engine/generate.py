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
building inside the window (step t+1's graph, built while step t computes), net of step t's
fill points and of queueing step t's next piece (on CPU, MLX's async_eval blocks until little
is left queued: that is waiting on compute); `eval_ns` the rest. Without lookahead a row is
[build start, token on host] and its build is its own.

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
Sampling is mlx-lm's (`make_sampler`: temperature, top_p, top_k), after mlx-lm's logits
processors when given (`make_logits_processors`: logit bias, repetition, presence and
frequency penalties), which see the prompt and every token so far, as in `generate_step`.
With `logprobs` (the number of alternatives, 0 for none) on_token gets each token's
log-probability and the top ones (after the processors, as the token was sampled).
With a prerouter (runtime.preroute) its state is reset at the start: a new sequence.
`runtime`: the streaming engine's (engine.engine.Engine.runtime; `Engine.generate` passes it),
None for a resident mlx-lm model. Its step clock (engine.step_clock) holds the step whose
loads are being done, so load rows carry it.
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
    logits_processors: list[Callable[[mx.array, mx.array], mx.array]] | None = None,
    stop_check: Callable[[], str | None] | None = None,
    on_token: Callable[[int, float | None, list], None] | None = None,
    prefill_step_size: int = 2048,
    stop_at_eos: bool = True,
    runtime=None,
    request: int = 0,
    step0: int = 0,
    lookahead: bool | None = None,
    on_text: Callable[[str], None] | None = None,
    on_step_start: StepStart | None = None,
    on_step: StepEnd | None = None,
) -> GenerationResult:
    from mlx_lm.generate import generation_stream
    from mlx_lm.sample_utils import make_sampler

    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise ValueError("empty prompt")
    if seed is not None:
        mx.random.seed(seed)
    loop = StepLoop(model, runtime, make_sampler(temp, top_p=top_p, top_k=top_k), logprobs,
                    request, step0, lookahead, on_step_start, on_step, logits_processors)
    out: list[int] = []
    detok = tokenizer.detokenizer
    detok.reset()
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])

    def emit(token: int, chosen: float | None, top: list) -> str | None:
        """Take a sampled token; a finish reason from stop_check ends the request."""
        out.append(token)
        if on_token is not None:
            on_token(token, chosen, top)
        detok.add_token(token)
        _emit(detok, on_text)
        return stop_check() if stop_check is not None else None

    try:
        with mx.stream(generation_stream):
            t0, t1, finish_reason = loop.run(
                ids, max_tokens, prefill_step_size, emit,
                (lambda token: token in eos) if stop_at_eos else (lambda token: False))
    except BaseException:
        loop.reset()
        raise
    t2 = time.perf_counter()
    detok.finalize()
    _emit(detok, on_text)

    steps = loop.steps
    decode_steps = sum(1 for s in steps if s["phase"] == "decode")
    prefill_s, decode_s = t1 - t0, t2 - t1
    return GenerationResult(
        tokens=out, text=detok.text, prompt_tokens=len(ids), prefill_s=prefill_s,
        decode_s=decode_s, prefill_tok_s=len(ids) / prefill_s if prefill_s > 0 else 0.0,
        decode_tok_s=decode_steps / decode_s if decode_s > 0 and decode_steps else 0.0,
        finish_reason=finish_reason, steps=steps,
    )


class StepLoop:
    """One request's forward steps, each built, evaluated (its fill points resolved) and
    recorded as a step row: the module docstring's loop, in named steps."""

    def __init__(self, model, runtime, sampler, logprobs: int | None, request: int,
                 step0: int, lookahead: bool | None, on_step_start: StepStart | None,
                 on_step: StepEnd | None, processors: list | None = None) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.model, self.runtime, self.sampler, self.logprobs = model, runtime, sampler, logprobs
        self.request, self.next_step = request, step0
        self.on_step_start, self.on_step = on_step_start, on_step
        self.cache = make_prompt_cache(model)
        self.fills = runtime.fills if runtime is not None else FillPoints()
        self.clock = self.fills.clock  # the step every load is labelled with
        # Fill points only when no single-token layer syncs while the graph is built: such a
        # sync would evaluate the layers before it, fill points not yet resolved included.
        self.deferring = runtime is None or not runtime.syncs_at_build("decode")
        if lookahead is None:
            lookahead = runtime.config.lookahead if runtime is not None else True
        self.lookahead = lookahead and self.deferring
        self.preroute = runtime.preroute if runtime is not None else None
        if self.preroute is not None:  # a new sequence: no previous token, nothing predicted
            self.preroute.reset()
        self.steps: list[dict] = []
        self.processors = processors or []
        self.history: mx.array | None = None  # tokens the processors see (lazy, as mlx-lm's)

    def _seen(self, tokens: mx.array) -> mx.array | None:
        """The token history with `tokens` appended (only kept when processors need it)."""
        if self.processors:
            h = self.history
            self.history = tokens if h is None else mx.concatenate([h, tokens])
        return self.history

    def run(self, ids: list[int], max_tokens: int, prefill_step_size: int,
            emit: Callable[[int, float | None, list], str | None],
            is_end: Callable[[int], bool]) -> tuple[float, float, str]:
        """Prefill (all prompt tokens but the last in chunks; the last one's step yields token
        0), then decode until `is_end` (EOS: "stop"), `emit` returns a finish reason, or
        `max_tokens` ("length"). Returns (start, end of prefill, finish reason)."""
        t0 = time.perf_counter()
        rest = ids
        while len(rest) > 1:
            n = min(prefill_step_size, len(rest) - 1)
            self.prefill_chunk(rest[:n])
            rest = rest[n:]
        b = self.build(mx.array(rest), "prefill", sample=True)
        token, nxt, chosen, top = self.finish(b, b.span[0], [b.span], want_next=max_tokens > 1)
        t1 = time.perf_counter()
        emitted = 0
        while True:
            if is_end(token):
                reason = "stop"
            else:
                reason = emit(token, chosen, top)
                emitted += 1
            if reason is not None:
                if nxt is not None:
                    self.abandon(nxt)
                return t0, t1, reason
            if emitted >= max_tokens:
                return t0, t1, "length"
            if nxt is None:  # no lookahead: build this step now, inside its own window
                nxt = self.build(mx.array([token]), "decode", sample=True)
                start, spans = nxt.span[0], [nxt.span]
            else:  # built during the previous window
                start, spans = self.steps[-1]["end_ns"], []
            token, nxt, chosen, top = self.finish(nxt, start, spans,
                                                  want_next=emitted + 1 < max_tokens)

    def build(self, tokens: mx.array, phase: str, sample: bool) -> _Built:
        """Build a forward step's graph (its fill points collected, not resolved)."""
        step = self.next_step
        self.next_step += 1
        self.clock.step = step
        if self.on_step_start is not None:
            self.on_step_start(step, phase, tokens.size)
        b0 = time.perf_counter_ns()
        if self.deferring:
            self.fills.tokens = tokens  # a first-layer hint reads it (engine.first_layer_hint)
            with self.fills.collecting():
                logits = self.model(tokens[None], cache=self.cache)
        else:
            logits = self.model(tokens[None], cache=self.cache)
        out = lp = None
        history = self._seen(tokens)
        if sample:
            logits = logits[:, -1, :]
            for processor in self.processors:
                logits = processor(history, logits)
            lp = logits - mx.logsumexp(logits, keepdims=True)
            out = self.sampler(lp)
        # The prerouter's predictions for the next call are side outputs of this step: queued
        # with it, so they are ready when the next step's staging asks for them as it begins.
        preroute = self.preroute
        also = list(preroute.pending().values()) if preroute is not None and sample else []
        return _Built(step, phase, tokens.size, out, lp if self.logprobs is not None else None,
                      self.fills.take(), (b0, time.perf_counter_ns()), also)

    def record(self, b: _Built, start: int, spans: list[tuple[int, int]], end: int) -> None:
        """The step's row: its window [start, end) and the graph building inside it."""
        spans = [(max(a, start), min(z, end)) for a, z in spans if z > start and a < end]
        build_ns = sum(z - a for a, z in spans)
        row = {"step": b.step, "request": self.request, "phase": b.phase, "tokens": b.tokens,
               "start_ns": start, "build_ns": build_ns, "eval_ns": end - start - build_ns,
               "end_ns": end, "build_spans": spans}
        self.steps.append(row)
        if self.on_step is not None:
            self.on_step(row)

    def prefill_chunk(self, tokens: list[int]) -> None:
        """A prefill chunk: built, its fill points resolved in order, evaluated; no token."""
        b = self.build(mx.array(tokens), "prefill", sample=False)
        resolve(b.points, self.clock)
        mx.eval([c.state for c in self.cache])
        self.record(b, b.span[0], [b.span], time.perf_counter_ns())

    def finish(self, b: _Built, start: int, spans: list, want_next: bool
               ) -> tuple[int, _Built | None, float | None, list]:
        """Evaluate `b`, resolving its fill points; when looking ahead, build the next decode
        step and queue its evaluation before `b`'s token comes to the host, so the host work
        between tokens overlaps compute. Records `b`'s window from `start`. Returns (token,
        the next step or None, its log-probability and top alternatives when asked for)."""
        fills, nxt = self.fills, None
        self.clock.step = b.step
        if not b.begun:
            fills.begin(b.points, [*b.also, b.out] if b.also else b.out)
        if self.lookahead and want_next:
            fills.overlapping = True
            fills.busy = []
            nxt = self.build(b.out, "decode", sample=True)  # resolves b's points as it goes
            fills.drain()
            spans = spans + _minus(nxt.span, fills.busy)
            fills.begin(nxt.points, [*nxt.also, nxt.out] if nxt.also else nxt.out)
            nxt.begun = True
        else:
            fills.drain()
        token = int(b.out.item())
        chosen, top = None, []
        logprobs = self.logprobs
        if b.lp is not None:
            row = np.array(b.lp[0])
            chosen = float(row[token])
            best = np.argpartition(-row, logprobs - 1)[:logprobs] if logprobs else []
            top = sorted(((int(i), float(row[i])) for i in best), key=lambda t: -t[1])
        fills.overlapping = False
        self.record(b, start, spans, time.perf_counter_ns())
        return token, nxt, chosen, top

    def abandon(self, b: _Built) -> None:
        """A step built ahead that will not run (EOS): drop its staging, reuse its number."""
        self.next_step = b.step
        self.reset()  # its fill points never run: only its first router was queued

    def reset(self) -> None:
        """Forget every fill point, settle reads, drop staging (after a failure, or for a
        step that will not run)."""
        self.fills.abort()
        if self.runtime is not None:
            self.runtime.reset()


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
