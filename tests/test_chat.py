"""`ssdmoe chat` driven through its standard input: replies stream through the chat template
(each equals the engine's generate on the same rendered history and seed, its control
characters escaped), /stats reports the last reply's engine figures, /reset clears the history
(the next reply is generated from the new question alone), and EOF or /quit ends it. Then in a
real terminal (tmux): /help, an unknown command, Ctrl-C that stops a reply and keeps the
session, line editing and history, the context check, and turns dropped to fit."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.generate import generate
from engine.loader import load_streaming
from server.chat_session import CONTROL, escape
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
    assert f"> {escape(first)}\n> last reply:" in out
    assert f"> (history cleared)\n> {escape(after_reset)}\n" in out
    assert not CONTROL.search(out)  # nothing the model says reaches the terminal raw
    assert escape(first + after_reset) != first + after_reset  # (there was something to escape)
    stats = next(line for line in out.splitlines() if "last reply:" in line)
    assert re.search(r"decode [\d.]+ tok/s", stats) and re.search(r"loads \d+ \(\d+ cold\)",
                                                                 stats)


def test_chat_stats_before_any_reply_and_eof(tiny_random_converted):
    out = _chat(tiny_random_converted, "/stats\n")
    assert "(no reply yet)" in out


class Tmux:
    """A terminal: `ssdmoe chat` in a detached tmux session, typed into with send-keys and
    read with capture-pane."""

    def __init__(self, cmd: list[str], env: dict[str, str]):
        import os
        import shlex

        self.name = f"ssdmoe-chat-test-{os.getpid()}"
        line = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + \
            " ".join(map(shlex.quote, cmd))
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", "160", "-y", "60",
                        f"{line}; sleep 30"], check=True)

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def line(self, text: str) -> None:
        self.keys("-l", text)
        self.keys("Enter")

    def screen(self) -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-J", "-S", "-", "-t", self.name],
                              capture_output=True, text=True, check=True).stdout

    def wait(self, predicate, timeout: float = 120.0) -> str:
        import time

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.1)
        raise AssertionError(f"timed out; the terminal shows:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def test_chat_in_a_terminal(tiny_random_converted, tmp_path):
    import shutil

    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (scripts/setup.sh installs it where it can)")
    exe = Path(sys.executable).parent / "ssdmoe"
    # greedy tiny-random replies run to --max-tokens without EOS: long enough to interrupt
    term = Tmux([str(exe), "chat", str(tiny_random_converted), "--max-tokens", "1500",
                 "--temp", "0"], {"SSDMOE_NO_FAST_BLAS": "1", "XDG_STATE_HOME": str(tmp_path),
                                  "PATH": "/usr/bin:/bin"})
    try:
        term.wait(lambda s: "/help for commands" in s and s.rstrip().endswith(">"))
        term.line("/help")
        term.wait(lambda s: "Ctrl-C stops a reply" in s)
        term.line("/frobnicate now")
        term.wait(lambda s: "unknown command /frobnicate (/help lists them)" in s)

        term.line("hello")  # Ctrl-C while it streams: the reply stops, the session stays
        term.wait(lambda s: len(s.split("> hello", 1)[-1].strip()) > 20)
        term.keys("C-c")
        term.wait(lambda s: "(stopped)" in s)
        term.line("/stats")
        screen = term.wait(lambda s: "last reply:" in s)
        tokens = int(re.search(r"last reply: (\d+) tokens \(stopped\)", screen).group(1))
        assert 0 < tokens < 1500

        term.keys("Up")  # history: the last line again
        term.keys("Enter")
        term.wait(lambda s: s.count("last reply:") == 2)
        term.keys("-l", "/statx")  # line editing: erase a character, type another
        term.keys("BSpace")
        term.keys("-l", "s")
        term.keys("Enter")
        term.wait(lambda s: s.count("last reply:") == 3)

        term.line("x" * 700)  # alone it does not fit beside --max-tokens 1500 in 2048
        term.wait(lambda s: "leaves room for 548" in s and "with --max-tokens 1500" in s)

        term.line("hi")  # the whole 1500 tokens: afterwards the history no longer fits
        term.wait(lambda s: s.count("> ") >= 9 and s.rstrip().endswith(">"), timeout=300)
        term.line("hey")
        term.wait(lambda s: "no longer fit the context of 2048 tokens and were dropped" in s,
                  timeout=300)
        term.line("/quit")
        term.wait(lambda s: not s.rstrip().endswith(">"), timeout=30)
    finally:
        term.close()
    history = (tmp_path / "ssdmoe" / "chat_history").read_text()
    assert "hello" in history and "/stats" in history


def test_max_tokens_beyond_the_context_is_refused(tiny_random_converted, ssdmoe):
    r = ssdmoe("chat", str(tiny_random_converted), "--max-tokens", "3000")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "--max-tokens 3000" in lines[0] and "context of 2048" in lines[0]
