"""A real `ssdmoe serve` process on a free loopback port: started as the console script (or
`python -m ssdmoe_cli`), ready when /health answers, stopped by a signal. The load test and
the serving tests both drive the server this way. No MLX here: the server is another process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(self, model: Path, *args: str, timeout: float = 300.0,
                 env: dict[str, str] | None = None):
        """Start `ssdmoe serve MODEL --port P ARGS...`; RuntimeError when it exits or does not
        answer /health within `timeout` seconds."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).parent / "ssdmoe"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "ssdmoe_cli"]
        self.proc = subprocess.Popen([*cmd, "serve", str(model), "--port", str(self.port), *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: "
                                   f"{self.proc.stderr.read().strip()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become ready")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> tuple[int, str]:
        """Signal it (killed after `timeout` s) -> (exit status, what it wrote on stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode, self.proc.stderr.read()
