"""A real `ssdmoe serve` process on a free loopback port, for the serving tests: started as
the console script, ready when /health answers, stopped by a signal (it must exit 0)."""

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


class Server:
    def __init__(self, model: Path, *args: str, timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).parent / "ssdmoe"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "ssdmoe_cli"]
        env = {**os.environ, "SSDMOE_NO_FAST_BLAS": "1"}
        self.proc = subprocess.Popen([*cmd, "serve", str(model), "--port", str(self.port), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: "
                                   f"{self.proc.stderr.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become ready")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode, self.proc.stderr.read()

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "none"),
                      max_retries=0, timeout=kw.pop("timeout", 120.0), **kw)
