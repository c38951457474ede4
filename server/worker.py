"""The engine's one thread: requests run one at a time in arrival (FIFO) order, as the paper's
engine serves them (batching would change the working set). Every MLX call of a request
happens here; the ASGI side only queues jobs and reads their events.

A job's events, in order: ("delta", {"text", "tokens"}) per emitted token (text after stop
matching; tokens with their log-probabilities when asked for), then one of ("done", info) or
("error", info). A job whose client went away is cancelled: the decode loop checks after every
token, so the engine is free again within one decode step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

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


class Job:
    def __init__(self, number: int, params: GenParams, loop: asyncio.AbstractEventLoop):
        self.number = number  # the trace's `request`; response ids carry it
        self.params = params
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.queued_at = time.perf_counter()

    def emit(self, kind: str, data) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, data))
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass


def describe(err: BaseException) -> dict:
    """An engine failure as the error the client gets (one line, naming what failed)."""
    from contract.errors import BadInput, IOFault

    if isinstance(err, IOFault):
        return {"status": 500, "type": "server_error", "code": "expert_read_error",
                "message": " ".join(str(err).split())}
    if isinstance(err, BadInput | ValueError):
        return {"status": 400, "type": "invalid_request_error", "code": None,
                "message": " ".join(str(err).split())}
    return {"status": 500, "type": "server_error", "code": type(err).__name__,
            "message": " ".join(str(err).split()) or type(err).__name__}


class Worker:
    def __init__(self, engine, recorder=None):
        self.engine, self.recorder = engine, recorder
        self.tokenizer = engine.tokenizer
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.running: Job | None = None
        self.next_step = 0  # trace step numbers continue across requests
        self._numbers = iter(range(1 << 62))
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ssdmoe-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def number(self) -> int:
        with self._lock:
            return next(self._numbers)

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def pending(self) -> int:
        return self.jobs.qsize() + (self.running is not None)

    def close(self, timeout: float = 30.0) -> None:
        """Cancel the running job and whatever is queued, then stop the thread."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled.set()
                job.emit("error", {"status": 503, "type": "server_error",
                                   "code": "shutting_down", "message": "server shutting down"})
        if self.running is not None:
            self.running.cancelled.set()
        self.jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            self.running = job
            try:
                job.emit("done", self._generate(job))
            except BaseException as err:  # noqa: BLE001 - any failure ends this request only
                job.emit("error", describe(err))
            finally:
                self.running = None

    def _generate(self, job: Job) -> dict:

        p = job.params
        matcher = StopMatcher(p.stops)
        out = {"text": "", "tokens": [], "sent": 0.0}  # what the next event carries
        decode = self.tokenizer.decode
        last: list[dict] = []

        def on_token(token: int, logprob: float | None, top: list) -> None:
            if logprob is None:
                return
            # a token's text is the detokenizer's segment that follows it (on_text), so the
            # tokens' texts concatenate to the reply
            last[:] = [{"id": token, "text": "", "logprob": logprob,
                        "top": [(decode([i]), lp) for i, lp in top]}]
            out["tokens"].append(last[0])

        def on_text(segment: str) -> None:
            out["text"] += matcher.feed(segment)
            if last:
                last[0]["text"] += segment

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
            flush()
            return "stop" if matcher.stopped else None

        hooks = self.recorder.hooks() if self.recorder is not None else {}
        t0 = time.perf_counter()
        r = self.engine.generate(p.prompt, p.max_tokens, temp=p.temp, top_p=p.top_p,
                                 top_k=p.top_k, seed=p.seed, logprobs=p.logprobs,
                                 request=job.number, step0=self.next_step, on_text=on_text,
                                 on_token=on_token, stop_check=stop_check, **hooks)
        if r.steps:
            self.next_step = r.steps[-1]["step"] + 1
        if not matcher.stopped and r.finish_reason != "cancelled":
            flush(final=True)  # the detokenizer's last bytes, what stop matching held back
        return {"finish_reason": r.finish_reason, "completion_tokens": len(r.tokens),
                "decode_tok_s": r.decode_tok_s, "queued_s": t0 - job.queued_at,
                "prefill_s": r.prefill_s}
