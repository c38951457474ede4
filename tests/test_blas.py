"""OpenBLAS preloading: the re-exec really happens, keeps the command line, can be disabled, and
MLX float32 matmuls agree with and without the preloaded library (and with float64 numpy)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.blas import DISABLE_ENV, fast_blas_active, openblas_path

LIB = openblas_path()
needs_lib = pytest.mark.skipif(LIB is None, reason="Debian OpenBLAS (libopenblas0-pthread) absent")
ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", DISABLE_ENV, "_SSDMOE_BLAS_REEXEC")}
    env.update(extra)
    return env


def _run(code: str, *args: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=_env(**env),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


REEXEC = (
    "import os, sys\n"
    "from engine.blas import reexec_with_fast_blas\n"
    "reexec_with_fast_blas()\n"
    "maps = open('/proc/self/maps').read()\n"
    "print(repr(sys.argv[1:]), os.environ.get('LD_PRELOAD', ''), 'openblas' in maps)\n"
)


@needs_lib
def test_reexec_preloads_openblas_and_keeps_arguments():
    out = _run(REEXEC, "a b", "--flag").split()
    assert out[-2:] == [str(LIB), "True"]
    assert " ".join(out[:-2]) == repr(["a b", "--flag"])


@needs_lib
def test_reexec_disabled_by_env():
    out = _run(REEXEC, "x", **{DISABLE_ENV: "1"}).split()
    assert out[-1] == "False"  # no OpenBLAS mapped, no LD_PRELOAD printed
    assert str(LIB) not in out


def test_fast_blas_active_reads_ld_preload(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/some/other.so")
    assert not fast_blas_active()
    if LIB is not None:
        monkeypatch.setenv("LD_PRELOAD", f"/some/other.so:{LIB}")
        assert fast_blas_active()


MATMUL = (
    "import sys, numpy as np, mlx.core as mx\n"
    "rng = np.random.default_rng(0)\n"
    "a = rng.standard_normal((192, 256), dtype=np.float32)\n"
    "b = rng.standard_normal((256, 160), dtype=np.float32)\n"
    "c = mx.array(a) @ mx.array(b)\n"
    "g = mx.grad(lambda w: ((mx.array(a) @ w) ** 2).sum())(mx.array(b))\n"
    "np.save(sys.argv[1], np.concatenate([np.array(c).ravel(), np.array(g).ravel()]))\n"
)


@needs_lib
def test_matmul_agrees_with_and_without_openblas(tmp_path):
    plain, fast = tmp_path / "plain.npy", tmp_path / "fast.npy"
    _run(MATMUL, str(plain), **{DISABLE_ENV: "1"})
    _run(MATMUL, str(fast), LD_PRELOAD=str(LIB))
    rng = np.random.default_rng(0)
    a = rng.standard_normal((192, 256), dtype=np.float32).astype(np.float64)
    b = rng.standard_normal((256, 160), dtype=np.float32).astype(np.float64)
    ref = np.concatenate([(a @ b).ravel(), (2 * a.T @ (a @ b)).ravel()])
    for got in (np.load(plain), np.load(fast)):
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5
    assert np.abs(np.load(plain) - np.load(fast)).max() / np.abs(ref).max() < 1e-5


SPLIT_MATMUL = (  # a float32 matmul big enough for OpenBLAS to split its reduction over threads
    "import hashlib, os, sys\n"
    "from engine.blas import reexec_with_fast_blas\n"
    "reexec_with_fast_blas()\n"
    "import mlx.core as mx\n"
    "a = mx.random.normal((256, 8192), key=mx.random.key(0))\n"
    "b = mx.random.normal((8192, 256), key=mx.random.key(1))\n"
    "c = a @ b\n"
    "mx.eval(c)\n"
    "import numpy as np\n"
    "print(hashlib.sha256(np.array(c).tobytes()).hexdigest()[:16],"
    " os.environ.get('OPENBLAS_NUM_THREADS'), os.environ.get('OPENBLAS_CORETYPE'))\n"
)


@needs_lib
def test_the_reexec_pins_openblas_so_results_do_not_depend_on_threads():
    """The premise: OpenBLAS gives other bits with 1 and 2 threads. The fix: the re-executed
    process pins one thread (and on x86-64 the Haswell kernels), so the result is the same
    whatever the machine's thread setting; a value the user set still wins."""
    import platform

    one = _run(SPLIT_MATMUL, **{"OPENBLAS_NUM_THREADS": "1",
                                "OPENBLAS_CORETYPE": "Haswell"}).split()
    two = _run(SPLIT_MATMUL, **{"OPENBLAS_NUM_THREADS": "2",
                                "OPENBLAS_CORETYPE": "Haswell"}).split()
    pinned = _run(SPLIT_MATMUL).split()
    assert two[1:] == ["2", "Haswell"] and one[1:] == ["1", "Haswell"]
    if os.cpu_count() and os.cpu_count() > 1:
        assert one[0] != two[0], "OpenBLAS gave the same bits with 1 and 2 threads"
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    assert pinned[1:] == ["1", "Haswell" if x86 else "None"]
    if x86:
        assert pinned[0] == one[0]  # pinned = one thread, Haswell: whatever the machine says
