"""A real `ssdmoe serve` process for the serving tests (server.serve_process), without the
OpenBLAS re-execution, with an `openai` client at hand; it must exit 0 when stopped."""

from __future__ import annotations

from pathlib import Path

from server.serve_process import ServeProcess


class Server(ServeProcess):
    def __init__(self, model: Path, *args: str, timeout: float = 120.0):
        super().__init__(model, *args, timeout=timeout, env={"SSDMOE_NO_FAST_BLAS": "1"})

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "none"),
                      max_retries=0, timeout=kw.pop("timeout", 120.0), **kw)
