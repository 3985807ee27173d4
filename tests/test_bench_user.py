"""``pufferfish bench`` on the user's own model (``--model PATH.py:FUNC``, ``module:FUNC``,
``hf:CONFIG.json``) and under the user's ``torchrun`` (one machine, and two "machines": network
namespaces joined by a veth pair, one torchrun node in each).

The bad references and flag combinations run in this process (one line, exit 2, nothing
written); the measurements are real ``torchrun`` jobs over real gloo groups.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import free_port, run_cli

from pufferfish.bench import Workload
from pufferfish.bench.launched import TORCHRUN_LINK
from pufferfish.bench.netns import EmulatedLink, netns_available
from pufferfish.bench.usermodel import build_user_model, factorization_report, load_workload
from pufferfish.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "bench_my_model.py"

WORKLOADS = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch import nn
    from pufferfish.bench import Workload


    def make():
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                              nn.Linear(256, 10))
        return Workload(model=model, loss=F.cross_entropy,
                        make_batch=lambda b: (torch.randn(b, 64), torch.randint(10, (b,))))


    def not_a_workload():
        return {"model": None}


    def raises():
        raise RuntimeError("no GPU here")


    def nothing():  # a 4 x 1 matrix: no rank below 1 saves anything
        return Workload(model=nn.Sequential(nn.Linear(4, 1)), loss=lambda o, t: o.sum(),
                        make_batch=lambda b: (torch.randn(b, 4), None))


    def detached():
        w = make()
        w.loss = lambda o, t: F.cross_entropy(o.detach(), t)
        return w


    def bad_keep():
        w = make()
        w.keep = ["head*"]
        return w


    def bad_batch():
        w = make()
        w.make_batch = lambda b: (torch.randn(b, 3), torch.randint(10, (b,)))  # not 64 features
        return w


    def vector_loss():
        w = make()
        w.loss = lambda o, t: F.cross_entropy(o, t, reduction="none")
        return w


    class Tempered(nn.Module):
        """Logits times a learned 0-d temperature, and a second head the loss never reads."""

        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
            self.head, self.aux = nn.Linear(256, 10), nn.Linear(256, 10)
            self.scale = nn.Parameter(torch.tensor(1.0))

        def forward(self, x):
            h = self.body(x)
            return {"logits": self.head(h) * self.scale, "aux": self.aux(h)}


    def unused():
        return Workload(model=Tempered(), loss=lambda o, t: F.cross_entropy(o["logits"], t),
                        make_batch=lambda b: (torch.randn(b, 64), torch.randint(10, (b,))))


    def tempered():
        w = unused()
        w.find_unused_parameters = True
        return w


    def weight_normed():
        w = make()
        w.model[2] = torch.nn.utils.weight_norm(nn.Linear(256, 256))
        return w


    def whole_ratio():
        w = make()
        w.rank_ratio = 1  # an int: the whole rank, not rank 1
        return w


    def text_ratio():
        w = make()
        w.rank_ratio = "0.5"
        return w


    class Recurrent(nn.Module):
        def __init__(self, packed=False):
            super().__init__()
            self.rnn, self.head, self.packed = nn.LSTM(16, 64, batch_first=True), nn.Linear(64, 10), packed

        def forward(self, x):
            self.rnn.flatten_parameters()  # as cuDNN users write it
            if self.packed:
                x = nn.utils.rnn.pack_padded_sequence(x, [x.shape[1]] * len(x), batch_first=True)
            _, (h, _) = self.rnn(x)
            return self.head(h[-1])


    def recurrent(packed=False):
        return Workload(model=Recurrent(packed), loss=F.cross_entropy,
                        make_batch=lambda b: (torch.randn(b, 5, 16), torch.randint(10, (b,))))


    def packed():
        return recurrent(packed=True)


    NOT_CALLABLE = 3
''')

# Small and quick: every method's steps, a few of them.
STEPS = ["--steps", "4", "--warmup", "2", "--compute-steps", "2", "--batch-size", "16",
         "--threads", "1"]


@pytest.fixture
def workloads(tmp_path: Path) -> Path:
    """The workloads above in a file outside the repository, in a folder whose name has a space."""
    path = tmp_path / "my models" / "nets.py"
    path.parent.mkdir()
    path.write_text(WORKLOADS)
    return path


def _bench_error(args: list[str], out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """``pufferfish bench ARGS`` in this process: its one-line error (exit 2, nothing written)."""
    try:
        rc = main(["bench", *args, "--out", str(out)])
    except SystemExit as e:  # argparse's own errors (an unknown flag)
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("pufferfish: error:"), err
    assert not out.exists()
    return err


@pytest.mark.parametrize(("ref", "needle"), [
    ("{dir}/missing.py:make", "no file '{dir}/missing.py'"),
    ("{path}:absent", "has no 'absent'"),
    ("{path}:raises", "raises() raised RuntimeError: no GPU here"),
    ("{path}:not_a_workload", "not_a_workload() returned a dict, allowed a "
                              "pufferfish.bench.Workload"),
    ("{path}:nothing", "Pufferfish has nothing to factorize in Sequential"),
    ("{path}:bad_keep", "matches no module"),
    ("{path}:bad_batch", "a step on make_batch(2) raised RuntimeError: mat1 and mat2"),
    ("{path}:vector_loss", "loss(outputs, targets) returned Tensor (2,), allowed a scalar"),
    ("{path}:NOT_CALLABLE", "NOT_CALLABLE is not a function (int)"),
    ("{path}:", "is invalid: allowed PATH.py:FUNC, package.module:FUNC or hf:CONFIG.json"),
    ("no_such_package.models:make", "cannot import 'no_such_package.models'"),
    ("hf:{dir}/config.json", "no file '{dir}/config.json'"),
    ("resnet50", "model 'resnet50' is invalid for the benchmark"),
    ("{path}:unused", "2 trainable parameter(s) get no gradient from the loss (aux.weight, "
                      "aux.bias), which stops DDP at its second step: allowed "
                      "Workload(find_unused_parameters=True)"),
    ("{path}:weight_normed", "copying the model raised RuntimeError"),
    ("{path}:detached", "loss(outputs, targets) does not depend on any trainable parameter"),
    ("{path}:whole_ratio", "Pufferfish has nothing to factorize in Sequential"),
    ("{path}:text_ratio", "Workload.rank_ratio '0.5' is invalid: allowed a number in (0, 1]"),
    ("{path}:packed", "a step on make_batch(2) on the factorized model (rank ratio 0.25) raised "
                      "TypeError: LowRankLSTM does not accept PackedSequence input"),
])
def test_bad_reference_is_one_line(ref: str, needle: str, workloads: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    fill = {"path": str(workloads), "dir": str(workloads.parent)}
    err = _bench_error(["--model", ref.format(**fill), "--methods", "ddp,pufferfish"],
                       tmp_path / "out", capsys)
    assert needle.format(**fill) in err


def test_methods_and_modes_that_need_our_models(workloads: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    ref = f"{workloads}:make"
    for args, needle in ((["--methods", "ddp,galore"], "method 'galore' is invalid with your"),
                         (["--methods", "ddp,fsdp"], "method 'fsdp' is invalid with your"),
                         (["--train"], "--train and --accuracy-runs train our models")):
        assert needle in _bench_error(["--model", ref, *args], tmp_path / "out", capsys)


def test_nothing_to_factorize_is_fine_without_pufferfish(workloads: Path) -> None:
    """Only a Pufferfish method needs layers to factorize: DDP and PowerSGD measure any model."""
    from pufferfish.bench.config import BenchConfig

    BenchConfig(model=f"{workloads}:nothing", methods=["ddp", "powersgd"]).validate()


def test_hf_without_transformers_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ImportError
    err = _bench_error(["--model", f"hf:{config}"], tmp_path / "out", capsys)
    assert "needs transformers, which is not installed: pip install transformers" in err


@pytest.mark.parametrize(("args", "needle"), [
    (["--bandwidth", "100mbit"], "--bandwidth 100mbit is invalid under torchrun"),
    (["--bandwidth", "loopback"], "--bandwidth loopback is invalid under torchrun"),
    (["--workers", "4"], "--workers 4 is invalid under torchrun"),
    (["--train"], "--train is invalid under torchrun"),
    (["--from-results", "x"], "--from-results x is invalid under torchrun"),
    (["--link", "1gbit"], "unrecognized arguments: --link 1gbit"),
    (["--nproc", "2"], "unrecognized arguments: --nproc 2"),
])
def test_flags_refused_under_torchrun(args: list[str], needle: str, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """What torchrun's environment decides (its link, its processes) cannot also be a flag."""
    for key, value in (("TORCHELASTIC_RUN_ID", "test"), ("RANK", "0"), ("WORLD_SIZE", "2"),
                       ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(key, value)
    assert needle in _bench_error(["--methods", "ddp", *args], tmp_path / "out", capsys)


def test_one_process_under_torchrun_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    for key, value in (("TORCHELASTIC_RUN_ID", "test"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_RANK", "0")):
        monkeypatch.setenv(key, value)
    err = _bench_error(["--methods", "ddp"], tmp_path / "out", capsys)
    assert "torchrun started 1 process(es): allowed >= 2" in err


def test_the_references_name_the_same_workload(workloads: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``package.module:FUNC`` and ``PATH.py:FUNC`` load the same factory; the model a method
    gets is a fresh copy carrying the loss, factorized as the report says."""
    monkeypatch.syspath_prepend(str(workloads.parent))
    by_module = load_workload("nets:make")
    by_path = load_workload(f"{workloads}:make")
    assert isinstance(by_module, Workload) and isinstance(by_path, Workload)
    report = factorization_report(f"{workloads}:make")
    model, full = build_user_model(f"{workloads}:make", 64, factorized=True)
    assert full == report.params_before == 85_002
    assert sum(p.numel() for p in model.parameters()) == report.params_after < full
    assert model is not by_path.model


def test_the_documented_example_keeps_its_head_full_rank() -> None:
    report = factorization_report(f"{EXAMPLE}:make")
    kept = {d.name for d in report.layers if not d.factorized}
    assert kept == {"4"} and len(report.factorized) == 2


# -- under torchrun -------------------------------------------------------------------------------


def _results(out: Path) -> dict[str, Any]:
    return json.loads((out / "results.json").read_text())


def _check_measured(result: dict[str, Any], methods: list[str], processes: int) -> None:
    """Every method measured over torchrun's probed link; what each sends per step is its
    gradients: 4 bytes per parameter of its (factorized, for Pufferfish) model."""
    (link,) = result["links"]
    assert link["bandwidth"] == TORCHRUN_LINK and link["processes"] == processes
    assert link["link_bps"] > 0 and link["link_rtt_s"] > 0
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == set(methods) and not result["failures"]
    assert all(r["workers"] == processes and r["step_time"] > 0 for r in rows.values())
    assert rows["ddp"]["bytes_per_step"] == 4 * rows["ddp"]["params"]
    assert rows["ddp"]["params"] == rows["ddp"]["params_full"]
    puff = rows["pufferfish"]
    assert puff["bytes_per_step"] == 4 * puff["params"] and puff["params"] < puff["params_full"]


def test_your_model_is_timed_in_its_own_layout_unless_asked(workloads: Path,
                                                            tmp_path: Path) -> None:
    """--channels-last: off for a Workload (timed as built), on for our models, a flag wins."""
    import argparse

    from pufferfish.bench.flags import add_arguments, config_from_args

    def channels_last(*argv: str) -> bool:
        ap = argparse.ArgumentParser()
        add_arguments(ap)
        args = ap.parse_args([*argv, "--methods", "ddp", "--out", str(tmp_path / "out")])
        return config_from_args(args).channels_last

    mine = f"{workloads}:make"
    assert not channels_last("--model", mine)
    assert channels_last("--model", mine, "--channels-last")
    assert channels_last("--model", "resnet18")
    assert not channels_last("--model", "resnet18", "--no-channels-last")


def test_checked_models_that_train(workloads: Path) -> None:
    """What the check lets through: an LSTM calling ``flatten_parameters`` (factorized too), a
    model whose unused head the workload declares."""
    from pufferfish.bench.usermodel import check_workload

    check_workload(f"{workloads}:recurrent", 64, factorized=True, rank_ratios=(None, 0.5))
    check_workload(f"{workloads}:tempered", 64, factorized=True)


def test_own_model_under_torchrun(workloads: Path, tmp_path: Path) -> None:
    """A model with a 0-d temperature (all-reduced plainly by PowerSGD) and a head the loss never
    reads (DDP told so by the workload), through every method's steps."""
    out = tmp_path / "bench"
    methods = ["ddp", "pufferfish", "powersgd"]
    run = run_cli("bench", "--model", f"{workloads}:tempered", "--methods", ",".join(methods),
                  "--rounds", "2", *STEPS, "--out", str(out), torchrun=2, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    report = factorization_report(f"{workloads}:tempered")
    assert f"parameters: {report.params_before:,} -> {report.params_after:,}" in run.stdout
    assert run.stdout.count("link probe over 2 processes") == 1  # rank 0 says it, once
    result = _results(out)
    _check_measured(result, methods, 2)
    assert {r["round"] for r in result["rounds"]} == {0, 1}
    assert result["rows"][1]["params"] == report.params_after
    assert (out / "results.md").exists() and (out / "step_time.png").exists()
    # reused outside torchrun: the same rows, the link and its probe as measured
    assert main(["bench", "--from-results", str(out), "--out", str(tmp_path / "again")]) == 0
    again = _results(tmp_path / "again")
    assert again["links"] == result["links"] and again["config"]["torchrun"]
    assert [r["step_time"] for r in again["rows"]] == [r["step_time"] for r in result["rows"]]


def test_hf_config_under_torchrun(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = tmp_path / "tiny-llama" / "config.json"
    config.parent.mkdir()
    transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                             max_position_embeddings=64).to_json_file(str(config))
    out = tmp_path / "bench"
    methods = ["ddp", "pufferfish", "diloco"]
    run = run_cli("bench", "--model", f"hf:{config}", "--methods", ",".join(methods),
                  "--rounds", "1", "--seq-len", "16", *STEPS, "--batch-size", "4",
                  "--out", str(out), torchrun=2, cwd=tmp_path, env={"OMP_NUM_THREADS": "2"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "model.layers.1.mlp.down_proj" in run.stdout  # the report: LLaMA's preset applied
    result = _results(out)
    _check_measured(result, methods, 2)
    # --threads 1 reached each process, not the environment's OMP_NUM_THREADS (torchrun's own
    # default, 1, kept every process at one thread whatever --threads said)
    assert {r["threads"] for r in result["rows"]} == {1}


needs_netns = pytest.mark.skipif(netns_available() is not None,
                                 reason=f"network namespaces unavailable: {netns_available()}")


@needs_netns
def test_two_machines_under_torchrun(workloads: Path, tmp_path: Path) -> None:
    """Two namespaces joined by a veth pair (unshaped: 10 Gbit/s), a torchrun node in each with
    one process, rendezvousing over the veth addresses: the code path of a two-node job."""
    out = tmp_path / "bench"
    methods = ["ddp", "pufferfish", "powersgd"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with EmulatedLink(10 * 10**9) as link:
        common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", link.addresses[0],
                  "--master-port", str(free_port())]
        bench = ["-m", "pufferfish", "bench", "--model", f"{workloads}:make", "--methods",
                 ",".join(methods), "--rounds", "2", *STEPS, "--out", str(out)]
        nodes = [subprocess.Popen(
            link.command(i, [sys.executable, "-m", "torch.distributed.run", *common,
                             "--node-rank", str(i), *bench]),
            env={**env, **link.env(i)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, cwd=tmp_path) for i in range(2)]
        try:
            done = [p.communicate(timeout=300) for p in nodes]
        finally:
            for p in nodes:
                p.kill()
    for p, (_, err) in zip(nodes, done, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert "link probe over 2 processes" in done[0][0]
    result = _results(out)
    _check_measured(result, methods, 2)
    assert result["links"][0]["nodes"] == 2


def test_under_torchrun_each_rank_takes_its_node_s_device_and_the_group_s_backend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pufferfish.bench.step import rank_device

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    count = torch.cuda.device_count()
    expected = torch.device("cuda", 1 % count) if count else torch.device("cpu")
    assert rank_device("auto", cpu_only=False) == expected  # the backend: join_group's
    assert rank_device("auto", cpu_only=True) == torch.device("cpu")  # FSDP2
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device 'cuda' is invalid here"):
            rank_device("cuda", cpu_only=False)
