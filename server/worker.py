"""The engine's one thread: requests run one at a time in arrival (FIFO) order, as the paper's
engine serves them (batching would change the working set). Every MLX call of a request
happens here; the ASGI side only queues jobs and reads their events.

A job's events, in order: ("delta", {"text", "tokens"}) per emitted token (text after stop
matching; tokens with their log-probabilities when asked for), then one of ("done", info) or
("error", info). A job whose client went away is cancelled: the decode loop checks after every
token, so the engine is free again within one decode step.

Load is bounded: the queue holds at most `max_queue` jobs (`submit` refuses beyond), and a job
past its deadline (arrival + the request time limit) ends with an error, queued or running.
`shutdown()` ends every queued and running job with a 503 at once, so their clients get a
complete answer before the server exits. Around every request the expert files are checked
against the ones verified at load (engine.file_watch).
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from server.stops import StopMatcher

COALESCE_S = 0.025  # streamed tokens closer together than this share one event


@dataclass
class GenParams:
    prompt: list[int]
    max_tokens: int
    temp: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stops: list[str] = field(default_factory=list)
    logprobs: int | None = None  # alternatives per token; None: no log-probabilities
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None

    def processors(self) -> list | None:
        """mlx-lm's logits processors for the bias and penalties (None when there are none)."""
        if not (self.logit_bias or self.presence_penalty or self.frequency_penalty
                or self.repetition_penalty):
            return None
        from mlx_lm.sample_utils import make_logits_processors

        return make_logits_processors(
            logit_bias=self.logit_bias or None, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)


def failure(status: int, code: str | None, message: str, kind: str = "server_error") -> dict:
    return {"status": status, "type": kind, "code": code, "message": message}


SHUTTING_DOWN = failure(503, "shutting_down", "server shutting down")


class Job:
    def __init__(self, number: int, params: GenParams, loop: asyncio.AbstractEventLoop,
                 deadline: float = math.inf):
        self.number = number  # the trace's `request`; response ids carry it
        self.params = params
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.queued_at = time.perf_counter()
        self.deadline = deadline  # perf_counter time after which it ends with an error
        self.ended = False  # its last event ("done" or "error") is out
        self._lock = threading.Lock()  # the engine thread and shutdown may both end it

    def emit(self, kind: str, data) -> bool:
        """Queue an event; False when the job had already ended (nothing sent)."""
        with self._lock:
            if self.ended:
                return False
            self.ended = kind in ("done", "error")
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, data))
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass
        return True

    def timed_out(self) -> dict:
        return failure(408, "request_timeout", "the request ran past the server's time "
                       "limit (--request-timeout)", "invalid_request_error")


def describe(err: BaseException, root: Path | None = None) -> dict:
    """An engine failure as the error the client gets (one line, naming what failed; paths
    relative to the model directory, so clients never see the server's file system)."""
    from contract.errors import BadInput, IOFault

    text = " ".join(str(err).split()) or type(err).__name__
    if root is not None:
        text = text.replace(f"{root}/", "")
    if isinstance(err, IOFault):
        from engine.file_watch import ExpertFileChanged

        code = "expert_file_changed" if isinstance(err, ExpertFileChanged) else \
            "expert_read_error"
        return failure(500, code, text)
    if isinstance(err, BadInput | ValueError):
        return failure(400, None, text, "invalid_request_error")
    return failure(500, type(err).__name__, text)


class Worker:
    def __init__(self, engine, recorder=None, max_queue: int = 64,
                 observe: Callable[[Job, str, dict], None] | None = None):
        """`max_queue`: jobs that may wait (the running one not counted); `observe(job,
        outcome, info)` hears how each job ended (metrics)."""
        self.engine, self.recorder = engine, recorder
        self.tokenizer = engine.tokenizer
        self.max_queue, self.observe = max_queue, observe
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.running: Job | None = None
        self.closing = False
        self.next_step = 0  # trace step numbers continue across requests
        self.mean_s = 1.0  # running mean of a job's time on the engine (Retry-After)
        self._numbers = iter(range(1 << 62))
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ssdmoe-engine", daemon=True)
        self.root = engine.manifest.root.resolve()
        self.files = _watch(engine)

    def start(self) -> None:
        self._thread.start()

    def number(self) -> int:
        with self._lock:
            return next(self._numbers)

    def submit(self, jobs: list[Job]) -> bool:
        """Queue `jobs` together (FIFO, adjacent); False when the queue has no room for them
        all or the server is shutting down."""
        with self._lock:
            if self.closing or self.jobs.qsize() + len(jobs) > self.max_queue:
                return False
            for job in jobs:
                self.jobs.put(job)
            return True

    def queued(self) -> int:
        return self.jobs.qsize()

    def pending(self) -> int:
        return self.jobs.qsize() + (self.running is not None)

    def retry_after(self, jobs: int = 1) -> int:
        """Seconds until about `jobs` places free up in the queue."""
        return max(1, math.ceil(self.mean_s * max(self.pending() - self.max_queue + jobs, 1)))

    def shutdown(self) -> None:
        """End every queued and running job with a 503 now; refuse new ones."""
        with self._lock:
            self.closing = True
            drained = []
            while True:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    drained.append(job)
        running = self.running
        for job in [*drained, *([running] if running is not None else [])]:
            job.cancelled.set()
            self._end(job, "error", SHUTTING_DOWN)

    def close(self, timeout: float = 30.0) -> None:
        """Shut down, then stop the thread."""
        self.shutdown()
        self.jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _end(self, job: Job, kind: str, info: dict) -> None:
        if job.emit(kind, info) and self.observe is not None:
            outcome = "ok" if kind == "done" else info.get("code") or "error"
            self.observe(job, outcome, info)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                self._end(job, "error", failure(499, "cancelled", "client closed the request",
                                                "invalid_request_error"))
                continue
            if time.perf_counter() > job.deadline:
                self._end(job, "error", job.timed_out())
                continue
            self.running = job
            t0 = time.perf_counter()
            try:
                if self.files is not None:
                    self.files.check()
                done = self._generate(job)
                if self.files is not None:
                    self.files.check()  # changed during the request: its output is not trusted
                if done["finish_reason"] == "timeout":
                    self._end(job, "error", job.timed_out())
                elif self.closing:
                    self._end(job, "error", SHUTTING_DOWN)
                else:
                    self._end(job, "done", done)
            except BaseException as err:  # noqa: BLE001 - any failure ends this request only
                self._end(job, "error", describe(err, self.root))
            finally:
                self.running = None
                self.mean_s += 0.2 * (time.perf_counter() - t0 - self.mean_s)

    def _generate(self, job: Job) -> dict:
        p = job.params
        matcher = StopMatcher(p.stops)
        out = {"text": "", "tokens": [], "sent": 0.0}  # what the next event carries
        first: list[float] = []  # when the first token came out

        def on_token(token: int, logprob: float | None, top: list) -> None:
            if not first:
                first.append(time.perf_counter())
            if logprob is not None:
                out["tokens"].append({"id": token, "logprob": logprob, "top": top})

        def on_text(segment: str) -> None:
            out["text"] += matcher.feed(segment)

        def flush(final: bool = False) -> None:
            if final:
                out["text"] += matcher.flush()
            now = time.perf_counter()
            # Tokens closer together than COALESCE_S go out as one event: each event wakes
            # the event loop, whose Python work takes the interpreter lock from the decode
            # loop. A token after a longer gap goes out at once, so slow decoding adds no delay.
            due = final or matcher.stopped or now - out["sent"] >= COALESCE_S
            if due and (out["text"] or out["tokens"]):
                job.emit("delta", {"text": out["text"], "tokens": out["tokens"]})
                out["text"], out["tokens"], out["sent"] = "", [], now

        def stop_check() -> str | None:
            if job.cancelled.is_set():
                return "cancelled"
            if time.perf_counter() > job.deadline:
                return "timeout"
            flush()
            return "stop" if matcher.stopped else None

        hooks = self.recorder.hooks() if self.recorder is not None else {}
        t0 = time.perf_counter()
        r = self.engine.generate(p.prompt, p.max_tokens, temp=p.temp, top_p=p.top_p,
                                 top_k=p.top_k, seed=p.seed, logprobs=p.logprobs,
                                 logits_processors=p.processors(), request=job.number,
                                 step0=self.next_step, on_text=on_text, on_token=on_token,
                                 stop_check=stop_check, **hooks)
        if r.steps:
            self.next_step = r.steps[-1]["step"] + 1
        if not matcher.stopped and r.finish_reason not in ("cancelled", "timeout"):
            flush(final=True)  # the detokenizer's last bytes, what stop matching held back
        return {"finish_reason": r.finish_reason, "completion_tokens": len(r.tokens),
                "prompt_tokens": len(p.prompt), "decode_tok_s": r.decode_tok_s,
                "queued_s": t0 - job.queued_at, "prefill_s": r.prefill_s,
                "ttft_s": (first[0] - job.queued_at) if first else None,
                "decode_s": r.decode_s}


def _watch(engine):
    """The engine's FileWatch (None for an engine without an expert store, e.g. a stand-in)."""
    store = getattr(engine, "store", None)
    runtime = getattr(engine, "runtime", None)
    if store is None or runtime is None:
        return None
    from engine.file_watch import FileWatch

    m = engine.manifest
    return FileWatch(m, {layer: store.file_path(layer) for layer in m.layers},
                     runtime.forget, store.reopen)
