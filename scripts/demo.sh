#!/usr/bin/env bash
# Setup (idempotent) then the main job on the built-in default model: build the tiny-trained
# fixture (offline, ~10 min the first time, cached under models/), convert it to the streaming
# layout, generate text from SSD while recording a trace, and summarise the trace.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
uv run ssdmoe demo "$@"
