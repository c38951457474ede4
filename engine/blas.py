"""Fast BLAS for MLX on Linux. The `mlx[cpu]` wheel bundles a reference BLAS (~5 GFLOPS sgemm);
preloading Debian's OpenBLAS (package libopenblas0-pthread) makes float32 matmuls ~35x faster,
which is what makes training a fixture in minutes possible. LD_PRELOAD only takes effect at
process start, so we re-execute the current command once with it set. Never imports MLX.

OpenBLAS's results depend on its thread count (it splits a matmul's reduction across threads)
and, on x86, on the kernels it picks for the CPU: the same fixture build gave different weights
with 1 and 2 threads (reports/fixtures/reproducibility.md). The re-executed process therefore
runs OpenBLAS with one thread and, on x86-64, the Haswell (AVX2) kernels every x86-64 CPU since
2013 runs (`PINNED`; variables the user set win), so a build gives the same bytes on any such
machine, whatever its core count. On this 2-core machine that costs nothing measurable.

Disable with SSDMOE_NO_FAST_BLAS=1."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

DISABLE_ENV = "SSDMOE_NO_FAST_BLAS"
# OpenBLAS settings that make its results machine-independent (see the module docstring)
PINNED = {"OPENBLAS_NUM_THREADS": "1"}
PINNED_X86 = {"OPENBLAS_CORETYPE": "Haswell"}
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
    for key, value in pinned_settings().items():
        env.setdefault(key, value)
    # orig_argv keeps interpreter flags and `-m module` / `-c code`, so the same command reruns.
    argv = [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)


def pinned_settings() -> dict[str, str]:
    """The OpenBLAS environment a re-executed process runs with on this machine."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return {**PINNED, **(PINNED_X86 if x86 else {})}


def blas_settings() -> dict[str, str | None]:
    """What this process computes with (for a fixture's or report's provenance)."""
    return {"openblas": str(openblas_path()) if fast_blas_active() else None,
            **{k: os.environ.get(k) for k in (*PINNED, *PINNED_X86)}}
