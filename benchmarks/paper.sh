#!/usr/bin/env bash
# The paper beside us, in one command: benchmarks/paper.py writes runs/paper/report.md (every claim
# of the paper with its figure, ours, the cached runs reused and what differs) and its plots.
#   benchmarks/paper.sh [--cache benchmarks/results] [--out runs/paper]   (PYTHON=... to choose)
set -euo pipefail
cd "$(dirname "$0")/.."
# $PYTHON, else the repository's .venv, else the python on PATH (an installed pufferfish).
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=$(command -v python3 || command -v python); fi
fi
exec "$PYTHON" benchmarks/paper.py "$@"
