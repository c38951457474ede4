#!/usr/bin/env bash
# Setup (idempotent) then the whole check: lint and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$HOME/.local/bin:$PATH"
uv run ruff check .
uv run pytest -q "$@"
