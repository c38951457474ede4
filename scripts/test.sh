#!/usr/bin/env bash
# Setup (idempotent) then the whole check: lint and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
uv run ruff check .
uv run pytest -q "$@"
