"""A terminal chat's state: the message history through the chat template, one streamed reply
at a time on the engine, the context kept within the model's (oldest turns dropped first),
and the last reply's engine figures for /stats."""

from __future__ import annotations

import re
from collections.abc import Callable

from contract.errors import BadInput
from server.chat_template import render

# C0 and C1 control characters but newline and tab: a model's output must not move the
# terminal's cursor, change its colours or retitle its window
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def escape(text: str) -> str:
    """Control characters as visible escapes (\\x1b), so a reply cannot garble the terminal."""
    return CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class ChatSession:
    def __init__(self, engine, loads: list[dict], max_tokens: int = 128, temp: float = 0.8,
                 seed: int = 0, context: int | None = None):
        self.engine, self.tokenizer, self.loads = engine, engine.tokenizer, loads
        self.max_tokens, self.temp, self.seed = max_tokens, temp, seed
        self.context = context or int(
            engine.manifest.config.get("max_position_embeddings") or 4096)
        if max_tokens >= self.context:
            raise BadInput(f"--max-tokens {max_tokens} leaves no room for a prompt in the "
                           f"model's context of {self.context} tokens")
        self.messages: list[dict[str, str]] = []
        self.last: dict | None = None
        self.replies = 0

    def reset(self) -> None:
        self.messages = []

    def _prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        return len(self.tokenizer.encode(render(self.tokenizer, messages)))

    def fit(self, text: str) -> tuple[list[dict[str, str]], int]:
        """The messages to send with `text` as the next user turn, and how many earlier turns
        were dropped (oldest first) so that prompt + max_tokens fits the context. BadInput
        when the turn does not fit alone."""
        room = self.context - self.max_tokens
        turn = [{"role": "user", "content": text}]
        alone = self._prompt_tokens(turn)
        if alone > room:
            raise BadInput(f"this message is {alone} tokens; with --max-tokens "
                           f"{self.max_tokens} the model's context of {self.context} tokens "
                           f"leaves room for {room}")
        history, dropped = list(self.messages), 0
        while history and self._prompt_tokens(history + turn) > room:
            history = history[2:] if len(history) > 1 else []  # a user turn and its reply
            dropped += 1
        return history + turn, dropped

    def reply(self, text: str, show: Callable[[str], None],
              stop: Callable[[], bool] = lambda: False) -> tuple[str, int]:
        """Stream a reply to `text` through `show`; `stop()` true ends it at the next token.
        Returns (the reply, turns dropped to fit the context)."""
        messages, dropped = self.fit(text)
        prompt = render(self.tokenizer, messages)
        stats = self.engine.stats
        before, first_load = stats.snapshot(), len(self.loads)
        r = self.engine.generate(prompt, self.max_tokens, temp=self.temp,
                                 seed=self.seed + self.replies, on_text=show,
                                 stop_check=lambda: "cancelled" if stop() else None)
        self.replies += 1
        self.messages = [*messages, {"role": "assistant", "content": r.text}]
        d = stats.delta(stats.snapshot(), before)
        decode = [s for s in r.steps if s["phase"] == "decode"]
        loads = self.loads[first_load:]
        self.last = {"tokens": len(r.tokens), "decode_tok_s": r.decode_tok_s,
                     "prefill_tok_s": r.prefill_tok_s, "stopped": r.finish_reason == "cancelled",
                     "blocked_ms_per_step": d["blocked_ns"] / 1e6 / max(len(decode), 1),
                     "cache_hits": d["cache_hits"], "cache_misses": d["cache_misses"],
                     "cold_loads": sum(1 for x in loads if x.get("cold")),
                     "loads": len(loads)}
        return r.text, dropped

    def stats_line(self) -> str:
        s = self.last
        if s is None:
            return "(no reply yet)"
        return (f"last reply: {s['tokens']} tokens{' (stopped)' if s['stopped'] else ''}, "
                f"decode {s['decode_tok_s']:.1f} tok/s, prefill {s['prefill_tok_s']:.1f} "
                f"tok/s, blocked {s['blocked_ms_per_step']:.2f} ms/step, cache hits "
                f"{s['cache_hits']} misses {s['cache_misses']}, loads {s['loads']} "
                f"({s['cold_loads']} cold)")
