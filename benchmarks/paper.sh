#!/usr/bin/env bash
# The paper beside us, in one command: benchmarks/paper.py writes runs/paper/report.md (every claim
# of the paper with its figure, ours, the cached runs reused and what differs) and its plots.
#   benchmarks/paper.sh [--cache benchmarks/results] [--out runs/paper]
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" benchmarks/paper.py "$@"
