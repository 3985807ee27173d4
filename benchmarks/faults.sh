#!/usr/bin/env bash
# Fault campaign of issue "Reliability": a tiny 2-process run under torchrun is killed at random
# points N times (also inside checkpoint writes), starved of disk, frozen, and has its checkpoints
# corrupted; prints the tally (faults injected, runs recovered, final parameters bitwise equal to
# an uninterrupted run, files lost). The disk-full fault mounts a tmpfs: root only, else skipped.
#   benchmarks/faults.sh [--kills N (3)] [--seed S (0)] [--workdir DIR] [--keep]
# About 6 minutes on 2 idle CPUs with the defaults (docs/reliability.md has a tally).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, in every process
OMP_NUM_THREADS=1 exec "$PY" benchmarks/faults.py "$@"
