#!/usr/bin/env bash
# One-time setup on a fresh machine: uv, the locked Python environment and, on Debian/Ubuntu
# Linux, OpenBLAS (MLX's CPU wheel ships reference BLAS; OpenBLAS makes fixture training ~10x
# faster: see engine/blas.py) and tmux (for the terminal chat test). Safe to run again: every step is skipped when already done.
# test.sh and demo.sh `source` it so the PATH it sets (a freshly installed uv) carries over.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v uv >/dev/null 2>&1; then
    python3 -m pip install --quiet uv || python3 -m pip install --quiet --user uv
    scripts_dir=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
    export PATH="$scripts_dir:$HOME/.local/bin:$PATH"
fi

if [ "$(uname -s)" = "Linux" ]; then
    blas=/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libblas.so.3
    if [ ! -e "$blas" ]; then
        if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
            echo "setup: installing OpenBLAS (libopenblas0-pthread) for fast CPU matmuls"
            (apt-get update -qq && apt-get install -y -qq libopenblas0-pthread >/dev/null) \
                || echo "setup: OpenBLAS install failed; training falls back to slow reference BLAS"
        else
            echo "setup: OpenBLAS not found; install libopenblas0-pthread for ~10x faster training"
        fi
    fi
    # tmux: the terminal that `ssdmoe chat`'s test types into (skipped without it)
    if ! command -v tmux >/dev/null 2>&1 && [ "$(id -u)" = "0" ] \
            && command -v apt-get >/dev/null 2>&1; then
        (apt-get update -qq && apt-get install -y -qq tmux >/dev/null) \
            || echo "setup: tmux install failed; the terminal chat test will be skipped"
    fi
fi

uv sync --frozen --quiet --all-extras  # extras too: the Ray backend is tested
