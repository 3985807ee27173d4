"""``python -m pufferfish`` (and the ``pufferfish`` console script): the CLI as a process.

The exit goes through :func:`pufferfish.distributed.env.exit_process`: after a distributed run
that failed, gloo may still have work in flight that a normal interpreter shutdown would turn
into an abort (SIGABRT) instead of the command's exit status.
"""

import traceback

from .cli import main
from .distributed.env import exit_process


def run() -> None:
    try:
        status = main()
    except Exception:  # --debug lets errors through: Python's traceback and exit status
        traceback.print_exc()
        status = 1
    exit_process(status)


if __name__ == "__main__":
    run()
