"""``pufferfish bench``: links with a latency (``--bandwidth 100mbit@20ms``) and fair baselines
(one optimizer per workload, PowerSGD's work inside its timed step, ``--compute-ms
full=MS,factorized=MS``). Pure functions and synthetic results, plus one 1-process gloo group; the
real delayed link is in ``tests/test_netns.py``."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import DDP_ROWS, PUFF_ROWS, accuracy_runs, write_train_run

from pufferfish.bench import projection as proj
from pufferfish.bench.bandwidth import parse_link
from pufferfish.bench.config import BenchConfig, parse_compute_ms
from pufferfish.bench.netns import qdisc_commands
from pufferfish.bench.results import project, projection_alphas
from pufferfish.bench.workload import make_optimizer
from pufferfish.cli import main

# -- parsing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("100mbit", (100_000_000, 0.0)), ("100mbit@20ms", (100_000_000, 20.0)),
    (" 1gbit@500us ", (1_000_000_000, 0.5)), ("10mbit@0ms", (10_000_000, 0.0)),
    ("loopback", (None, 0.0)), ("100mbit@2.5ms", (100_000_000, 2.5)),
])
def test_parse_link(text: str, expected: tuple[int | None, float]) -> None:
    assert parse_link(text) == expected


@pytest.mark.parametrize("text", ["100mbit@-1ms", "100mbit@abc", "100mbit@", "100mbit@20",
                                  "100mbit@20ms@1ms", "100mbit@5000ms", "loopback@1ms"])
def test_parse_link_refuses_in_one_line_naming_the_flag(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_link(text)
    msg = str(info.value)
    assert "\n" not in msg and f"--bandwidth entry {text!r} is invalid" in msg
    assert "RATE@DELAY" in msg and "100mbit@20ms" in msg


@pytest.mark.parametrize(("value", "expected"), [
    ("40", {"full": 40.0}), (12.5, {"full": 12.5}), ("full=40", {"full": 40.0}),
    ("full=40,factorized=22", {"full": 40.0, "factorized": 22.0}),
    (" factorized=2 , full=4 ", {"full": 4.0, "factorized": 2.0}),
    ("full=9.5,factorized=13.7,powersgd=38",
     {"full": 9.5, "factorized": 13.7, "powersgd": 38.0}),
    ("ddp=9.5,pufferfish+powersgd=20", {"ddp": 9.5, "pufferfish+powersgd": 20.0}),
])
def test_parse_compute_ms(value: Any, expected: dict[str, float]) -> None:
    assert parse_compute_ms(value) == expected


@pytest.mark.parametrize("value", ["", "0", "-5", "x", "factorized=20", "full=4,full=5",
                                   "full=4,lowrank=2", "full=inf", True, "powersgd=38",
                                   "full=9.5,gossip=3", "full=9.5,powersgd=0", "full=9.5,ddp"])
def test_parse_compute_ms_refuses(value: Any) -> None:
    with pytest.raises(ValueError, match=r"--compute-ms .* is invalid: allowed full=MS,factorized"):
        parse_compute_ms(value)


# -- the qdiscs built ------------------------------------------------------------------------------


def test_qdisc_chain_is_netem_then_tbf_with_a_delay_and_tbf_alone_without() -> None:
    plain = qdisc_commands("ns0", "veth0", 100_000_000, 0.0)
    assert [c[:7] for c in plain] == [["tc", "-n", "ns0", "qdisc", "add", "dev", "veth0"]]
    assert plain[0][7:11] == ["root", "tbf", "rate", "100000000bit"]
    netem, tbf = qdisc_commands("ns0", "veth0", 100_000_000, 20.0)
    assert netem[7:] == ["root", "handle", "1:", "netem", "delay", "20ms", "limit", "100000"]
    assert tbf[7:14] == ["parent", "1:1", "handle", "10:", "tbf", "rate", "100000000bit"]
    # tbf's queue grows with the round trip, so TCP's larger window still fits in it
    assert tbf[tbf.index("latency") + 1] == "90ms" and plain[0][-1] == "50ms"


# -- the projection's latency term -----------------------------------------------------------------


def test_latency_term_is_alpha_per_collective_times_collectives_per_step() -> None:
    # 8 workers, α = 20 ms: a ring all-reduce pays 2(p-1) = 14 messages per collective.
    ddp = proj.CommProfile.for_method("ddp", 0.1, 0.0, 40e6, collectives=5)  # 5 buckets
    psgd = proj.CommProfile.for_method("powersgd", 0.1, 0.01, 1e6, collectives=3 * 5)
    diloco = proj.CommProfile.for_method("diloco", 0.1, 0.0, 40e6 / 50, collectives=1 / 50)
    assert ddp.latency_term(8, 0.02) == pytest.approx(5 * 14 * 0.02)
    assert psgd.latency_term(8, 0.02) == pytest.approx(15 * 14 * 0.02)
    assert diloco.latency_term(8, 0.02) == pytest.approx(14 * 0.02 / 50)
    # The projection at two latencies differs by exactly that term, row by row.
    low, high = (proj.project([ddp, psgd, diloco], workers=(8,), bandwidths=(1e9,), alpha=a)
                 for a in (50e-6, 0.02))
    for a, b, prof in zip(low, high, (ddp, psgd, diloco)):
        assert (a["alpha"], b["alpha"]) == (50e-6, 0.02)
        assert b["step_time"] - a["step_time"] == pytest.approx(
            prof.latency_term(8, 0.02) - prof.latency_term(8, 50e-6))
    # Latency reverses the ranking: 15 round trips cost PowerSGD more than DDP's bytes at 1 Gbit/s.
    assert low[1]["speedup_vs_ddp"] > 1 > high[1]["speedup_vs_ddp"]


def test_link_alpha_probed_or_nominal() -> None:
    assert proj.link_alpha({"link_rtt_s": 0.04}, 2) == pytest.approx(0.02)  # 2 messages
    assert proj.link_alpha({"link_rtt_s": None, "delay_ms": 20.0}, 2, 50e-6) == pytest.approx(
        0.02005)
    assert proj.link_alpha({}, 2, 50e-6) == 50e-6  # older results: no delay recorded


def _rec(method: str, link: str, step: float, compute: float, nbytes: float,
         calls: float) -> dict[str, Any]:
    rate, delay = parse_link(link)
    return {"round": 0, "method": method, "bandwidth": link, "bandwidth_bps": rate,
            "delay_ms": delay, "link_bps": rate, "link_rtt_s": None, "workers": 2,
            "step_time": step, "compute_time": compute, "comm_time": step - compute,
            "compress_time": 0.0, "hook_time": 0.0, "bytes_per_step": nbytes,
            "ring_bytes_per_step": nbytes, "collectives_per_step": calls, "params": nbytes / 4,
            "factorized": method == "pufferfish"}


def test_projection_is_shown_at_each_links_latency(tmp_path: Path) -> None:
    from pufferfish.bench.markdown import results_markdown
    from pufferfish.bench.rounds import compute_check, summarize

    recs = summarize([_rec(m, link, 1.0, 0.2 if m == "ddp" else 0.1,
                           10e6 if m == "ddp" else 2.5e6, 4)
                      for link in ("100mbit", "100mbit@20ms") for m in ("ddp", "pufferfish")],
                     ["100mbit", "100mbit@20ms"], ["ddp", "pufferfish"])
    cfg = BenchConfig(out=str(tmp_path), methods=["ddp", "pufferfish"], rounds=1)
    assert projection_alphas(recs, cfg.alpha) == [cfg.alpha, cfg.alpha + 0.02]
    projection = project(recs, cfg)
    assert projection["alphas"] == [cfg.alpha, cfg.alpha + 0.02]
    assert len(projection["rows"]) == 2 * 2 * 3 * 3  # alphas x methods x workers x bandwidths
    # The 2-worker prediction of a measured row uses its link's latency: 4 buckets x 2 messages.
    far = next(r for r in recs if r["bandwidth"] == "100mbit@20ms" and r["method"] == "ddp")
    near = next(r for r in recs if r["bandwidth"] == "100mbit" and r["method"] == "ddp")
    assert far["model_alpha"] == pytest.approx(0.02005)
    assert far["predicted_step_time"] - near["predicted_step_time"] == pytest.approx(4 * 2 * 0.02)
    links = [{"bandwidth": b, "bandwidth_bps": 1e8, "delay_ms": d, "link_bps": 1e8,
              "link_rtt_s": r} for b, d, r in (("100mbit", 0.0, None), ("100mbit@20ms", 20.0,
                                                                         0.0403))]
    result = {"rows": recs, "rounds": recs, "projection": projection, "links": links,
              "order": [[("100mbit", ["ddp"])]], "compute_check": compute_check(recs),
              "time_to_accuracy": None, "skipped": [], "failures": []}
    md = results_markdown(cfg, result, plots=[])
    assert "| 100mbit@20ms | 100.0 Mbit/s | 20 ms | 100.0 Mbit/s | 40.3 ms |" in md
    assert "### p = 8, α = 50 µs" in md and "### p = 8, α = 20.05 ms" in md


def _results_json(path: Path) -> Path:
    """A saved bench on 100mbit and 100mbit@20ms (1 round), for --from-results."""
    recs = [{**_rec(m, link, step, step / 2, 2.8e6 if m == "ddp" else 0.86e6, 1.0),
             "workers": 2}
            for link, steps in (("100mbit", (1.0, 0.5)), ("100mbit@20ms", (1.1, 0.55)))
            for m, step in zip(("ddp", "pufferfish"), steps)]
    config = {"model": "resnet18", "width": 0.25, "methods": ["ddp", "pufferfish"],
              "bandwidths": ["100mbit", "100mbit@20ms"], "workers": 2, "batch_size": 64,
              "rounds": 1, "threads": 1}
    links = [{"bandwidth": b, "bandwidth_bps": 1e8, "delay_ms": d, "link_bps": 1e8,
              "link_rtt_s": None} for b, d in (("100mbit", 0.0), ("100mbit@20ms", 20.0))]
    path.write_text(json.dumps({"config": config, "rounds": recs, "rows": [], "skipped": [],
                                "failures": [], "links": links,
                                "order": [[[b, ["ddp", "pufferfish"]] for b in config[
                                    "bandwidths"]]]}))
    return path


@pytest.mark.parametrize("compute_ms", ["10", "full=10,factorized=4"])
def test_time_to_accuracy_at_two_latencies(tmp_path: Path, compute_ms: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    ddp = write_train_run(tmp_path / "full", DDP_ROWS)
    puff = write_train_run(tmp_path / "puff", PUFF_ROWS, mode="pufferfish", warmup_epochs="1")
    out = tmp_path / "out"
    rc = main(["bench", "--from-results", str(_results_json(tmp_path / "saved.json")),
               "--accuracy-runs", f"ddp={ddp},pufferfish={puff}", "--compute-ms", compute_ms,
               "--out", str(out)])
    said = capsys.readouterr().out
    assert rc == 0
    tta = json.loads((out / "results.json").read_text())["time_to_accuracy"]
    assert [c["regime"] for c in tta["measured"]["curves"]] == [
        "100mbit", "100mbit", "100mbit@20ms", "100mbit@20ms"]
    projected = tta["projected"]
    regimes = list(dict.fromkeys(c["regime"] for c in projected["curves"]))
    assert len(regimes) == 2 * 2 * 3  # alphas x workers x bandwidths
    assert "p=8, 1.0 Gbit/s, α 50 µs" in regimes and "p=8, 1.0 Gbit/s, α 20.05 ms" in regimes
    md = (out / "results.md").read_text()
    assert "α = 50 µs and 20.05 ms per message" in md
    if compute_ms == "10":  # the CPU's ratio (0.5 here), said in results.json, .md and the log
        assert projected["assumes_cpu_ratio"] and projected["factorized_compute_ms"] is None
        assert projected["lowrank_compute_ratio"] == pytest.approx(0.5)
        assert "ASSUMES the factorized model keeps the low-rank/full compute ratio" in md
        assert "note: --compute-ms gave no factorized=MS" in said
        assert "FALLS BACK to this machine's low-rank/full ratio (0.50) for pufferfish" in md
    else:
        assert not projected["assumes_cpu_ratio"] and projected["factorized_compute_ms"] == 4.0
        assert projected["lowrank_compute_ratio"] == pytest.approx(0.4)
        assert "from `--compute-ms full=10,factorized=4`" in md and "note:" not in said
        assert "a low-rank/full ratio of 0.40, this CPU's 0.50" in md
        assert "FALLS BACK" not in md


def test_projected_curves_take_the_factorized_figure() -> None:
    from pufferfish.bench import accuracy as acc

    profiles = [proj.CommProfile.for_method("ddp", 0.2, 0.0, 1e6),
                proj.CommProfile.for_method("pufferfish", 0.1, 0.0, 0.25e6)]
    curves, info = acc.projected_curves(accuracy_runs(), profiles, compute_ms=10.0, workers=(8,),
                                        bandwidths=(1e9,), alpha=0.0, factorized_ms=3.0)
    assert info["factorized_scale"] == pytest.approx(0.03) and not info["assumes_cpu_ratio"]
    # Pufferfish after the switch: 3 ms compute + 2*7/8 * 2e6 bit / 1 Gbit/s = 6.5 ms.
    assert curves[1].step_times == pytest.approx({"full": 0.024, "lowrank": 0.0065})


def test_delayed_link_without_netem_is_skipped_not_run_without_its_delay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pufferfish.bench import runner

    monkeypatch.setattr(runner, "netem_available", lambda: "netem delay unavailable")
    said: list[str] = []
    cfg = BenchConfig(methods=["ddp"], bandwidths=["100mbit@20ms"], out=str(tmp_path))
    result = runner.run_bench(cfg, log=said.append)
    assert result["rounds"] == [] and result["skipped"] == [
        {"bandwidth": "100mbit@20ms", "reason": "netem delay unavailable"}]
    assert any("run without their delay" in line for line in said)


# -- fair baselines --------------------------------------------------------------------------------


def _args(model: str) -> argparse.Namespace:
    return argparse.Namespace(model=model, lr=0.01, seq_len=64)


def test_one_optimizer_per_workload() -> None:
    from pufferfish.models import build_at_width

    lm = build_at_width("transformer", 0.125, vocab_size=50, max_len=16)
    for method in ("ddp", "pufferfish", "powersgd", "diloco", "fsdp"):
        opt = make_optimizer(_args("transformer"), method, lm)
        assert type(opt) is torch.optim.AdamW, method
        assert {g["weight_decay"] for g in opt.param_groups} == {1e-4, 0.0}  # decay split
    cnn = build_at_width("resnet18", 0.125, num_classes=10, in_channels=1, image_size=28)
    for method in ("ddp", "pufferfish", "powersgd"):
        opt = make_optimizer(_args("resnet18"), method, cnn)
        assert type(opt) is torch.optim.SGD and opt.defaults["momentum"] == 0.9
    pytest.importorskip("pytorch_optimizer")
    galore = make_optimizer(_args("transformer"), "galore", lm)
    assert galore.defaults["betas"] == (0.9, 0.999) and galore.defaults["lr"] == 0.01
    assert any("rank" in g for g in galore.param_groups)  # GaLore's own (projected) AdamW


def test_galore_is_refused_with_the_image_models_sgd() -> None:
    with pytest.raises(ValueError, match="method 'galore' is invalid with model 'resnet18'"):
        BenchConfig(methods=["ddp", "galore"]).validate()


# A process of its own: a gloo group with a comm hook in the test runner's process would leave
# gloo's threads (and the hook's callbacks they release) in it for the rest of the suite, which
# aborted the runner once (docs/reliability.md, "No abort at exit").
POWERSGD_STEP = """
import argparse, json, torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from pufferfish.bench.workload import make_optimizer, train_one_step
from pufferfish.distributed.env import cleanup, exit_process
from pufferfish.distributed.hooks import register_comm_hook
from pufferfish.training.step import Replica

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
ddp = DistributedDataParallel(model)
state = register_comm_hook(ddp, "powersgd", matrix_approximation_rank=2, start_powerSGD_iter=2)
optimizer = make_optimizer(argparse.Namespace(model="resnet18", lr=0.01, seq_len=64), "powersgd",
                           model)
replica = Replica(model, ddp, optimizer, hook_state=state)
batch = [(torch.randn(8, 32), torch.randint(0, 10, (8,)))]  # one micro-batch
for _ in range(3):  # DDP re-buckets after step 1; PowerSGD compresses from step 2
    train_one_step(replica, batch)
state.stats.reset()
train_one_step(replica, batch)
print(json.dumps(state.stats.snapshot()), flush=True)
cleanup()
exit_process(0)
"""


def test_powersgd_encode_and_decode_finish_inside_the_timed_step() -> None:
    """What ``bench.step`` times is ``train_one_step``: when it returns, PowerSGD has encoded,
    run its three all-reduces per bucket and decoded (the hook's end-to-end time is recorded by a
    callback on its final future, after the decode), so all of it is inside ``step_time``."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", POWERSGD_STEP], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats["buckets"] >= 1 and stats["comm_calls"] == 3 * stats["buckets"]
    assert stats["compress_time"] > 0  # encoded in this step
    assert stats["hook_time"] > 0  # ...and the final future (after the decode) completed
