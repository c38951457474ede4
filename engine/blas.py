"""Fast BLAS for MLX on Linux. The `mlx[cpu]` wheel bundles a reference BLAS (~5 GFLOPS sgemm);
preloading Debian's OpenBLAS (package libopenblas0-pthread) makes float32 matmuls ~35x faster,
which is what makes training a fixture in minutes possible. LD_PRELOAD only takes effect at
process start, so we re-execute the current command once with it set. Never imports MLX.

Disable with SSDMOE_NO_FAST_BLAS=1."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

DISABLE_ENV = "SSDMOE_NO_FAST_BLAS"
_MULTIARCH = {"x86_64": "x86_64-linux-gnu", "amd64": "x86_64-linux-gnu",
              "aarch64": "aarch64-linux-gnu", "arm64": "aarch64-linux-gnu"}


def openblas_path() -> Path | None:
    """Debian/Ubuntu's pthread OpenBLAS for this machine, or None if absent / not Linux."""
    if not sys.platform.startswith("linux"):
        return None
    triple = _MULTIARCH.get(platform.machine().lower())
    if triple is None:
        return None
    lib = Path(f"/usr/lib/{triple}/openblas-pthread/libblas.so.3")
    return lib if lib.exists() else None


def fast_blas_active() -> bool:
    lib = openblas_path()
    preloaded = os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
    return lib is not None and str(lib) in preloaded


def reexec_with_fast_blas() -> None:
    """Re-execute this process with OpenBLAS in LD_PRELOAD, if available and not already there.

    Returns normally (doing nothing) when disabled, not on Linux, the library is missing, it is
    already preloaded, or a previous re-exec already happened (loop guard)."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return
    lib = openblas_path()
    if lib is None or fast_blas_active() or os.environ.get("_SSDMOE_BLAS_REEXEC") == "1":
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(filter(None, [str(lib), env.get("LD_PRELOAD", "")]))
    env["_SSDMOE_BLAS_REEXEC"] = "1"
    # orig_argv keeps interpreter flags and `-m module` / `-c code`, so the same command reruns.
    argv = [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)
