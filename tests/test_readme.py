"""Every example of the README runs as written and exits cleanly, at tiny sizes.

The Python examples run in order in one namespace, as a reader would paste them; the trainer
examples get the objects their text leaves to the reader (``model``, ``args``, ``train``;
``module``, ``train_loader``; the prepared objects of Accelerate) from the tests' own tiny
setups, and the Accelerate one runs under ``torchrun`` twice (it must exit cleanly every time).
The commands run in order in one directory, each with the size flags of ``TINY`` appended (a
later flag wins), so that later commands find what earlier ones made.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import block_kind, free_port, needs_fashion, python_blocks

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

# Appended to each command of its kind: small data, width and steps (a later flag wins). 1024
# examples: the README's time-to-accuracy model needs a full batch of 16 for each of 64 workers.
TRAIN = ["--width", "0.125", "--train-subset", "1024", "--test-subset", "128", "--batch-size",
         "16", "--epochs", "1", "--threads", "1", "--no-progress"]
TINY = {
    "train": TRAIN,
    "resume": ["--epochs", "2", "--threads", "1", "--no-progress"],  # the run's own sizes
    "compare": [*TRAIN, "--train-subset", "256", "--epochs", "1", "--rounds", "1",
                "--latency-repeats", "1"],
    # loopback only: the emulated links' path is tests/test_bench.py's and test_netns.py's; torch's
    # buckets: the default's trial steps (--bucket-mb auto) are tests/test_bench.py's and
    # test_buckets.py's to check, not worth ~6 s per command here
    "bench": ["--width", "0.125", "--batch-size", "16", "--steps", "2", "--warmup", "2",
              "--compute-steps", "1", "--rounds", "1", "--threads", "1", "--bandwidth", "loopback",
              "--bucket-mb", "torch"],
    "bench-reuse": [],
    "factorize": [],
    "report": [],
    "--help": [],
}
NOT_RUN = {"make demo": "the demo itself (11 minutes)", "make test": "the test suite itself",
           "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "
           "HOST0:29400 --rdzv-id bench -m pufferfish bench --model "
           "examples/bench_my_model.py:make --out runs/cluster":
           "two machines: tests/test_bench_user.py runs it on two network namespaces",
           **{f"pip install {what}": "installing: done by the tests' environment"
              for what in (".", "'.[lm]'", "'.[galore]'")}}


def commands() -> list[str]:
    """Every command line of the README's bash blocks, continuation lines joined."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                found.append(" ".join(line.split()))
    return found


def test_the_library_examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each block runs as it is, in a namespace of its own: its imports are its own, and only
    what its comment names as the user's (a trainer's model and data) is given to it."""
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    import hf_trainer_run as hf
    import lightning_trainer_run as lt

    monkeypatch.chdir(tmp_path)  # where the trainers write their logs
    kinds = [block_kind(b) for b in python_blocks()]
    assert {"plain", "hf", "lightning", "accelerate"} <= set(kinds)
    recipes = []
    for block, kind in zip(python_blocks(), kinds, strict=True):
        namespace: dict[str, Any] = {}
        if kind == "hf":
            namespace.update(model=hf.tiny_gpt2(), train=hf.Tokens(),
                             args=hf.training_arguments(str(tmp_path / "hf"), num_train_epochs=2))
        elif kind == "lightning":
            namespace.update(module=lt.make_module(), train_loader=lt.data())
        elif kind == "accelerate":
            continue  # under torchrun: below
        exec(compile(block, "README.md", "exec"), namespace)
        if kind == "hf":
            assert namespace["callback"].report is not None  # it switched
        recipes += [namespace["recipe"]] if "recipe" in namespace else []
    assert recipes and all(r.report is not None for r in recipes)


ACCELERATE_SETUP = """
import sys
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup

sys.path.insert(0, {tests!r})
from hf_trainer_run import Tokens, tiny_gpt2

torch.set_num_threads(1)
accelerator = Accelerator(cpu=True)
model = tiny_gpt2()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = get_linear_schedule_with_warmup(optimizer, 2, 12)
loader = DataLoader(Tokens(), batch_size=4)
"""


def test_the_accelerate_example_under_torchrun_exits_cleanly(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    (block,) = [b for b in python_blocks() if block_kind(b) == "accelerate"]
    assert block.rstrip().splitlines()[-1].startswith("exit_process(0)")
    script = tmp_path / "train.py"
    script.write_text(ACCELERATE_SETUP.format(tests=str(ROOT / "tests")) + block)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # once: how often it aborted at exit before exit_process is benchmarks/no_abort.sh's to count
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                          "2", "--master-port", str(free_port()), str(script)],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "terminate called" not in run.stderr and "Traceback" not in run.stderr


def _argv(command: str) -> tuple[list[str], str]:
    """The command as this interpreter runs it, and its kind (the key of ``TINY``)."""
    words = shlex.split(command)
    if words[0] == "torchrun":
        words = ["-m", "torch.distributed.run", "--master-port", str(free_port()), *words[1:]]
        sub = words[words.index("pufferfish") + 1]
    else:
        assert words[0] == "pufferfish", command
        words, sub = ["-m", *words], words[1]
    kind = {"train": "resume" if "--resume" in words else "train",
            "bench": "bench-reuse" if "--from-results" in words else "bench"}.get(sub, sub)
    return [sys.executable, *words, *TINY[kind]], kind


@needs_fashion
def test_the_commands_run_in_order(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    shutil.copytree(ROOT / "examples", tmp_path / "examples")  # as in a checkout
    ran = []
    for command in commands():
        if command in NOT_RUN:
            continue
        argv, kind = _argv(command)
        run = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600,
                             cwd=tmp_path)
        assert run.returncode == 0, f"{command}\n{run.stderr[-3000:]}"
        assert "Traceback" not in run.stderr and "terminate called" not in run.stderr, command
        ran.append(kind)
    assert {"train", "resume", "report", "compare", "bench", "bench-reuse", "factorize"} <= set(ran)
    assert (tmp_path / "runs" / "tta" / "results.md").exists()


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_links_lead_to_their_sections() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#([^)]+))?\)", README)
    assert links
    for path, anchor in links:
        target = ROOT / path
        assert target.exists(), path
        if anchor:  # a heading's anchor, or an explicit <a id="..."> kept for an old link
            text = target.read_text()
            headings = re.findall(r"^#+ (.*)$", text, re.M)
            ids = re.findall(r'<a id="([^"]+)"></a>', text)
            assert anchor in {_slug(h) for h in headings} | set(ids), f"{path}#{anchor}"
