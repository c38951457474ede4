"""The server's Prometheus metrics (prometheus_client, one registry per app), served as the
text format at GET /metrics: the queue, requests by outcome, tokens, time to first token,
decode rate, and the engine's own counters (expert loads, cold loads, app-cache hits and
misses, time blocked on loads), read from the engine at scrape time."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from server.worker import Job, Worker

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500)


class EngineCounters:
    """A collector over the engine's cumulative counters (engine.paths.stats) and its loads."""

    def __init__(self, engine, loads: dict[str, int]):
        self.engine, self.loads = engine, loads

    def collect(self):
        stats = self.engine.stats.snapshot()
        yield CounterMetricFamily("ssdmoe_expert_loads", "Expert reads the engine did",
                                  value=self.loads["all"])
        yield CounterMetricFamily("ssdmoe_expert_cold_loads",
                                  "Expert reads that went to the device", value=self.loads["cold"])
        yield CounterMetricFamily("ssdmoe_cache_hits", "Routed experts found loaded",
                                  value=stats["cache_hits"])
        yield CounterMetricFamily("ssdmoe_cache_misses", "Routed experts that had to be read",
                                  value=stats["cache_misses"])
        yield CounterMetricFamily("ssdmoe_blocked_seconds",
                                  "Main-thread time blocked on expert reads",
                                  value=stats["blocked_ns"] / 1e9)


class Metrics:
    def __init__(self, worker: Worker):
        self.registry = r = CollectorRegistry()
        Gauge("ssdmoe_queue_length", "Requests waiting for the engine", registry=r) \
            .set_function(worker.queued)
        Gauge("ssdmoe_requests_running", "Requests on the engine now", registry=r) \
            .set_function(lambda: int(worker.running is not None))
        self.requests = Counter("ssdmoe_requests", "Sequences ended, by outcome",
                                ["outcome"], registry=r)
        self.rejected = Counter("ssdmoe_requests_rejected", "Requests refused for a full queue",
                                registry=r)
        self.prompt_tokens = Counter("ssdmoe_prompt_tokens", "Prompt tokens prefilled",
                                     registry=r)
        self.completion_tokens = Counter("ssdmoe_completion_tokens", "Tokens generated",
                                         registry=r)
        self.ttft = Histogram("ssdmoe_time_to_first_token_seconds",
                              "Arrival to first token, queueing included",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.decode_rate = Histogram("ssdmoe_decode_tokens_per_second",
                                     "Decode rate of each sequence", buckets=RATE_BUCKETS,
                                     registry=r)
        self.loads = {"all": 0, "cold": 0}
        engine = worker.engine
        if getattr(engine, "stats", None) is not None:
            r.register(EngineCounters(engine, self.loads))
            store = engine.store
            chained = store.on_load
            lock = threading.Lock()

            def on_load(row: dict) -> None:  # on the reader threads
                with lock:
                    self.loads["all"] += 1
                    self.loads["cold"] += bool(row.get("cold"))
                if chained is not None:
                    chained(row)

            store.on_load = on_load

    def observe(self, job: Job, outcome: str, info: dict) -> None:
        """How a job ended (Worker's `observe`)."""
        self.requests.labels(outcome).inc()
        if outcome != "ok":
            return
        self.prompt_tokens.inc(info["prompt_tokens"])
        self.completion_tokens.inc(info["completion_tokens"])
        if info.get("ttft_s") is not None:
            self.ttft.observe(info["ttft_s"])
        if info["decode_tok_s"] > 0:
            self.decode_rate.observe(info["decode_tok_s"])

    def text(self) -> bytes:
        return generate_latest(self.registry)
