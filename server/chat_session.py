"""A terminal chat's state: the message history through the chat template, one streamed reply
at a time on the engine, and the last reply's engine figures for /stats."""

from __future__ import annotations

from collections.abc import Callable

from server.chat_template import render


class ChatSession:
    def __init__(self, engine, loads: list[dict], max_tokens: int = 128, temp: float = 0.8,
                 seed: int = 0):
        self.engine, self.tokenizer, self.loads = engine, engine.tokenizer, loads
        self.max_tokens, self.temp, self.seed = max_tokens, temp, seed
        self.messages: list[dict[str, str]] = []
        self.last: dict | None = None
        self.replies = 0

    def reset(self) -> None:
        self.messages = []

    def reply(self, text: str, show: Callable[[str], None]) -> str:
        self.messages.append({"role": "user", "content": text})
        prompt = render(self.tokenizer, self.messages)
        stats = self.engine.stats
        before, first_load = stats.snapshot(), len(self.loads)
        r = self.engine.generate(prompt, self.max_tokens, temp=self.temp,
                                 seed=self.seed + self.replies, on_text=show)
        self.replies += 1
        self.messages.append({"role": "assistant", "content": r.text})
        d = stats.delta(stats.snapshot(), before)
        decode = [s for s in r.steps if s["phase"] == "decode"]
        loads = self.loads[first_load:]
        self.last = {"tokens": len(r.tokens), "decode_tok_s": r.decode_tok_s,
                     "prefill_tok_s": r.prefill_tok_s,
                     "blocked_ms_per_step": d["blocked_ns"] / 1e6 / max(len(decode), 1),
                     "cache_hits": d["cache_hits"], "cache_misses": d["cache_misses"],
                     "cold_loads": sum(1 for x in loads if x.get("cold")),
                     "loads": len(loads)}
        return r.text

    def stats_line(self) -> str:
        s = self.last
        if s is None:
            return "(no reply yet)"
        return (f"last reply: {s['tokens']} tokens, decode {s['decode_tok_s']:.1f} tok/s, "
                f"prefill {s['prefill_tok_s']:.1f} tok/s, blocked {s['blocked_ms_per_step']:.2f}"
                f" ms/step, cache hits {s['cache_hits']} misses {s['cache_misses']}, loads "
                f"{s['loads']} ({s['cold_loads']} cold)")
