"""`ssdmoe chat`'s terminal: line editing and a history kept across sessions (the standard
library's readline, when the input is a terminal), commands, Ctrl-C that stops the reply and
keeps the conversation, and replies with their control characters escaped."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from contract.errors import BadInput
from server.chat_session import ChatSession, escape

COMMANDS = {
    "/help": "list these commands",
    "/reset": "forget the conversation",
    "/stats": "the last reply's engine figures",
    "/quit": "leave (Ctrl-D too)",
}
HELP = "\n".join(f"  {c:<8} {what}" for c, what in COMMANDS.items()) + \
    "\n  Ctrl-C stops a reply; a line starting with // sends the rest with one /"
HISTORY_SIZE = 1000


def history_file() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "ssdmoe" / "chat_history"


def _line_editing(path: Path):
    """readline with a persistent history, when the input is a terminal; None otherwise."""
    if not sys.stdin.isatty():
        return None
    try:
        import readline
    except ImportError:  # a Python built without it: plain input
        return None
    readline.set_history_length(HISTORY_SIZE)
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    return readline


def run(session: ChatSession, banner: str, history: Path | None = None) -> None:
    out = sys.stdout
    history = history or history_file()
    editing = _line_editing(history)
    stop = threading.Event()
    out.write(banner + "\n")
    try:
        while True:
            try:
                line = input("> ") if editing else _plain_input(out)
            except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
                out.write("^C\n")
                continue
            if line is None:
                break
            text = line.strip()
            if text.startswith("/") and not text.startswith("//"):
                if text == "/quit":
                    break
                out.write(_command(session, text) + "\n")
                continue
            if not text:
                continue
            if text.startswith("//"):
                line = line.lstrip()[1:]
            stop.clear()
            previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
            try:
                _, dropped = session.reply(
                    line, lambda s: (out.write(escape(s)), out.flush()), stop.is_set)
            except BadInput as err:  # the turn does not fit: checked before generating
                out.write(f"({err})\n")
                continue
            finally:
                signal.signal(signal.SIGINT, previous)
            out.write(" (stopped)\n" if stop.is_set() else "\n")
            if dropped:
                out.write(f"(the oldest {dropped} turn{'s' * (dropped > 1)} no longer fit the "
                          f"context of {session.context} tokens and were dropped)\n")
    finally:
        if editing is not None:
            try:
                history.parent.mkdir(parents=True, exist_ok=True)
                editing.write_history_file(history)
            except OSError:
                pass


def _plain_input(out) -> str | None:
    out.write("> ")
    out.flush()
    line = sys.stdin.readline()
    return line.rstrip("\n") if line else None


def _command(session: ChatSession, text: str) -> str:
    if text == "/help":
        return HELP
    if text == "/reset":
        session.reset()
        return "(history cleared)"
    if text == "/stats":
        return session.stats_line()
    return f"unknown command {escape(text.split()[0])} (/help lists them)"
