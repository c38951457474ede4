"""Shared, session-scoped model fixtures (built once per test run, in seconds).

- tiny_random_dir:        mlx-lm dir of the `tiny-random` fixture (qwen3_moe, 4 x 32 experts)
- tiny_random_converted:  its streaming conversion (int4 g64, bundled layout)
- tiny_random_stacked:    the same in the version-1 stacked layout
- tiny_grouped_converted: the `tiny-grouped` fixture (bailing_moe sigmoid-group), converted
- arch_model(arch):       (source dir, converted dir) of `small_config(arch)` for each supported
                          architecture, built on first use
Tests must not modify these directories: copy them first (`model_copy(src)`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# A command run in this process (the `ssdmoe` fixture) must never re-execute it with OpenBLAS
# preloaded (engine.blas): that would restart pytest. tests/test_blas.py checks the re-exec in
# subprocesses of its own.
os.environ.setdefault("SSDMOE_NO_FAST_BLAS", "1")


@pytest.fixture(scope="session")
def tiny_random_dir(tmp_path_factory) -> Path:
    from engine.fixtures.random_models import build_tiny_random

    return build_tiny_random(tmp_path_factory.mktemp("tiny-random") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_random_converted(tiny_random_dir, tmp_path_factory) -> Path:
    from engine.convert import convert

    dst = tmp_path_factory.mktemp("tiny-random-converted") / "model"
    convert(tiny_random_dir, dst)
    return dst


@pytest.fixture(scope="session")
def tiny_random_stacked(tiny_random_dir, tmp_path_factory) -> Path:
    """tiny-random in the version-1 (stacked) layout: a bundle is one range per tensor."""
    from engine.convert import convert

    dst = tmp_path_factory.mktemp("tiny-random-stacked") / "model"
    convert(tiny_random_dir, dst, layout="stacked")
    return dst


@pytest.fixture(scope="session")
def tiny_grouped_converted(tmp_path_factory) -> Path:
    from engine.convert import convert
    from engine.fixtures.random_models import build_tiny_grouped

    root = tmp_path_factory.mktemp("tiny-grouped")
    src = build_tiny_grouped(root / "src", seed=0)
    convert(src, root / "converted")
    return root / "converted"


@pytest.fixture(scope="session")
def arch_model(tmp_path_factory):
    """arch_model(arch) -> (source dir, converted dir), cached for the session."""
    from engine.convert import convert
    from engine.fixtures.random_models import build_random

    built: dict[str, tuple[Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in built:
            root = tmp_path_factory.mktemp(arch)
            src = build_random(arch, root / "src", seed=1)
            convert(src, root / "converted")
            built[arch] = (src, root / "converted")
        return built[arch]

    return get


@pytest.fixture
def model_copy(tmp_path):
    """model_copy(src) -> a private copy of the directory `src` (to damage in bad-input tests)."""
    count = [0]

    def copy(src: Path) -> Path:
        count[0] += 1
        return Path(shutil.copytree(src, tmp_path / f"copy{count[0]}"))

    return copy


@pytest.fixture
def ssdmoe(monkeypatch, capsys):
    """ssdmoe(*args) runs the CLI in this process through ssdmoe_cli.main.main (fast: MLX is
    already imported) -> CompletedProcess(returncode, stdout, stderr)."""
    from cli_runner import run_cli

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(args, *run_cli(monkeypatch, capsys, *args))

    return run


@pytest.fixture
def ssdmoe_subprocess():
    """ssdmoe_subprocess(*args) runs the installed console script (a few seconds each)."""

    def run(*args: str) -> subprocess.CompletedProcess:
        exe = Path(sys.executable).parent / "ssdmoe"
        cmd = [str(exe), *args] if exe.exists() else \
            [sys.executable, "-c", "from ssdmoe_cli.main import main; main()", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    return run


@pytest.fixture
def store(tiny_random_converted):
    """An ExpertStore over tiny_random_converted whose load rows collect in `store.rows`."""
    from engine.manifest import read_manifest
    from engine.store import ExpertStore

    rows: list[dict] = []
    s = ExpertStore(read_manifest(tiny_random_converted), on_load=rows.append)
    s.rows = rows
    yield s
    s.close()
