#!/usr/bin/env bash
# The paper beside us, in one command: benchmarks/paper.py writes OUT/claims.json (every headline
# number, per seed), OUT/readme-results.md (README.md's Results table), OUT/report.md (every claim
# of the paper with its figure, ours, the cached runs reused and what differs) and the plots.
#   benchmarks/paper.sh [OUT] [--cache benchmarks/results] [--counts live|FILE] [--claims-only]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
exec "$PY" benchmarks/paper.py "$@"
