"""Run the `ssdmoe` CLI in this process (fast: MLX stays imported) and capture what it prints."""

from __future__ import annotations

import sys


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """-> (exit code, stdout, stderr) of `ssdmoe ARGS...` through ssdmoe_cli.main.main."""
    from ssdmoe_cli.main import main

    monkeypatch.setattr(sys, "argv", ["ssdmoe", *args])
    capsys.readouterr()
    code = 0
    try:
        main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err
