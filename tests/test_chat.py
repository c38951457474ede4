"""`ssdmoe chat` driven through its standard input: replies stream through the chat template
(each equals the engine's generate on the same rendered history and seed), /stats reports the
last reply's engine figures, /reset clears the history (the next reply is generated from the
new question alone), and EOF or /quit ends it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.generate import generate
from engine.loader import load_streaming
from server.chat_template import render

pytestmark = pytest.mark.slow


def _chat(model: Path, lines: str) -> str:
    exe = Path(sys.executable).parent / "ssdmoe"
    out = subprocess.run([str(exe), "chat", str(model), "--max-tokens", "12", "--temp", "0.8",
                          "--seed", "4"], input=lines, capture_output=True, text=True,
                         timeout=300, env={"SSDMOE_NO_FAST_BLAS": "1", "PATH": ""})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_chat_replies_stats_and_reset(tiny_random_converted):
    out = _chat(tiny_random_converted, "hello there\n/stats\n/reset\nhello there\n/quit\n")
    eng = load_streaming(tiny_random_converted)
    model, tok = eng.model, eng.tokenizer
    user = {"role": "user", "content": "hello there"}

    def reply(messages: list[dict], seed: int) -> str:
        return generate(model, tok, render(tok, messages), 12, temp=0.8, seed=seed,
                        runtime=eng.runtime).text

    first = reply([user], 4)
    after_reset = reply([user], 5)  # the seed moves on per reply
    without_reset = reply([user, {"role": "assistant", "content": first}, user], 5)
    eng.close()
    assert first and after_reset != without_reset
    assert f"> {first}\n> last reply:" in out
    assert f"> (history cleared)\n> {after_reset}\n" in out
    stats = next(line for line in out.splitlines() if "last reply:" in line)
    assert re.search(r"decode [\d.]+ tok/s", stats) and re.search(r"loads \d+ \(\d+ cold\)",
                                                                 stats)


def test_chat_stats_before_any_reply_and_eof(tiny_random_converted):
    out = _chat(tiny_random_converted, "/stats\n")
    assert "(no reply yet)" in out
