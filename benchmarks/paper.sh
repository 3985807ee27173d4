#!/usr/bin/env bash
# The paper beside us, in one command, from the cache only (no training): benchmarks/paper.py
# writes OUT/claims.json (every headline number, per seed; the claims are benchmarks/claims/),
# OUT/readme-results.md (README.md's Results table), OUT/report.md (every claim of the paper with
# its figure, ours, the cached runs reused and what differs) and the plots.
#   benchmarks/paper.sh [OUT] [--cache benchmarks/results] [--counts live|FILE] [--claims-only]
# Regenerate the README's rows and docs/benchmarks.md's claim blocks in place:
#   benchmarks/paper.sh OUT --readme README.md --docs docs/benchmarks.md --docs-img docs/img
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
exec "$PY" benchmarks/paper.py "$@"
