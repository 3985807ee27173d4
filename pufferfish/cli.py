"""The ``pufferfish`` command line: argument parsing only; every command calls into the library.

Bad input of any kind (flags, config files, data files, checkpoints) ends the command with a
one-line ``pufferfish: error: ...`` on stderr and exit status 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from . import __version__, factorize, models
from .baselines.compare import compare
from .bench.runner import add_arguments as add_bench_arguments
from .bench.runner import run_from_args
from .config import ConfigError, choices
from .configfile import (
    FIELDS,
    field_description,
    field_kind,
    load_config,
    read_config_file,
    shipped_configs,
)
from .data import DataError
from .distributed.env import idle_cpus
from .formatting import one_line
from .options import sections
from .report import compare_runs
from .training.checkpoint import CheckpointError
from .training.loop import PeerError, TrainingError, train
from .training.startup import load_run_config
from .training.tasks import resolve_short_try

__all__ = ["main"]

EXIT_FAILURE = 1  # the run failed for a reason outside this process (a peer crashed or froze)
EXIT_USAGE = 2  # bad input: flags, config, data, checkpoints, a diverging run


class _Parser(argparse.ArgumentParser):
    """``argparse`` with one-line errors and "did you mean" suggestions.

    argparse's own error prints a multi-line usage block before the message; under torchrun that
    block is repeated per rank and buries the one line that matters. Abbreviated flags are off:
    ``--warmup 2`` silently meaning ``--warmup-epochs`` (or being ambiguous once another flag
    starts the same way) is a configuration accident, not a convenience.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        sys.exit(_fail(_with_suggestion(self, message), EXIT_USAGE))


def _fail(message: str, status: int) -> int:
    """Say ``pufferfish: error: message`` in one line; return ``status``.

    Under torchrun every rank fails alike, and torchrun ends with its own traceback and a
    summary of the failed ranks. So rank 0 prints the line, and every rank also writes it to its
    torchelastic error file, which makes it the summary's "Root Cause" (the last lines the user
    sees) instead of "To enable traceback see: ...". No rank's message is lost: the summary lists
    each failed rank's.
    """
    line = f"pufferfish: error: {message}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        data = {"message": {"message": line, "extraInfo": {
            "py_callstack": line, "timestamp": str(int(time.time()))}}}
        with contextlib.suppress(OSError):
            Path(error_file).parent.mkdir(parents=True, exist_ok=True)
            Path(error_file).write_text(json.dumps(data))
    if not error_file or os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
    return status


def _with_suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """Add "did you mean" to argparse's unknown-flag and invalid-choice messages."""
    message = " ".join(message.split())
    if message.startswith("unrecognized arguments:"):
        flags = [a.split("=", 1)[0] for a in message.split(":", 1)[1].split() if a.startswith("-")]
        options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        close = difflib.get_close_matches(flags[0], options, n=1) if flags else []
        return message + (f" (did you mean {close[0]}?)" if close else "")
    m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if m:
        choices = re.findall(r"'([^']*)'", m.group(2))
        close = difflib.get_close_matches(m.group(1), choices, n=1)
        return message + (f" (did you mean {close[0]!r}?)" if close else "")
    return message


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    # parse_known_args + our own error: the unknown flag is then matched against the options of
    # the command it was given to, so the suggestion is one that command accepts.
    args, extras = parser.parse_known_args(argv)
    if extras:
        _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(extras)}")
    if args.command is None:
        parser.error("missing COMMAND (train, factorize, report, ...); see pufferfish --help")
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt as e:  # a run's says how to continue it (training.guards.Interrupted)
        print(f"pufferfish: interrupted{f'; {e}' if str(e) else ''}", file=sys.stderr)
        return 130
    except Exception as e:
        if getattr(args, "debug", False):
            raise

        if isinstance(e, PeerError):
            return _fail(one_line(e), EXIT_FAILURE)
        if not _is_user_error(e):
            raise
        return _fail(_as_typed(one_line(e), args), EXIT_USAGE)


def _as_typed(message: str, args: argparse.Namespace) -> str:
    """``message`` with the options the user gave as flags named as typed: ``--rank-ratio 2``.

    Library errors name an option by its config key (``rank_ratio 2 is out of range``), which is
    right for a TOML file but not for a flag. The one translation, here: a key given as a flag
    becomes the flag (a switch's ``overwrite true`` / ``false``: ``--overwrite`` /
    ``--no-overwrite``); a one-word key (``model``, ``epochs``) only where a value follows it.
    """
    if args.command not in ("train", "compare"):  # the commands with a flag per config key
        return message
    given = [k for k in FIELDS if getattr(args, k, None) is not None]
    for key in sorted(given, key=len, reverse=True):
        flag = "--" + key.replace("_", "-")
        edge = r"(?<![\w\-/.])" + key
        if field_kind(key) is bool:
            message = re.sub(edge + r" true\b", flag, message)
            message = re.sub(edge + r" false\b", "--no-" + flag[2:], message)
        follows = r"(?!\w)" if "_" in key else r"(?= ['\"\d\-\[(])"
        message = re.sub(edge + follows, flag, message)
    return message


def _is_user_error(e: Exception) -> bool:
    """Errors caused by what the user gave us (or their machine), reported in one line.

    ``OSError`` is included for the run directory's own failures (permission denied, disk full,
    ``--out`` naming a file): a traceback into ``os.replace`` helps nobody.
    """

    return isinstance(e, ConfigError | DataError | CheckpointError | TrainingError | ValueError
                      | OSError)


CONFIG_HELP = ("TOML file of training options, or a shipped config's name: "
               + ", ".join(shipped_configs()) + "; flags override it. Its keys at the top "
               "level, or in their group's table (the headings below: [optim] lr = 0.05)")


EXAMPLES = """\
first steps:
  pufferfish train --config resnet18_fashion --epochs 1 --train-subset 512 --width 0.25
      a try of a few minutes on a CPU (Fashion-MNIST: the Debian package dataset-fashion-mnist,
      or add --download); it ends with its result and run directory
  pufferfish factorize --model resnet18
      the paper's ResNet-18 factorized: each layer's rank and parameters, no training
  pufferfish report runs/RUN_A runs/RUN_B
      runs side by side (each `train` prints its run directory)
`pufferfish COMMAND --help` lists a command's options; --model llama needs
the tokenizers package (the [lm] extra)."""


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pufferfish",
        description="Communication-efficient distributed training with pre-factorized low-rank "
                    "networks (Pufferfish, MLSys 2021).",
        epilog=EXAMPLES, formatter_class=_ExamplesFormatter)
    parser.add_argument("--version", action="version",
                        version=f"pufferfish {__version__} (torch {torch.__version__})",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser("train", help="train a model (one process, or under torchrun: DDP)",
                           description="Every option is also a key of the --config TOML file; "
                                       "flags override the file.",
                           epilog=_model_defaults_epilog())
    train.add_argument("--config", help=CONFIG_HELP)
    train.add_argument("--debug", action="store_true", help="show tracebacks")
    _config_flags(train, skip=())
    train.set_defaults(run=_cmd_train)

    fact = sub.add_parser("factorize", help="factorize a paper model and print the report")
    fact.add_argument("--model", nargs="+", default=["resnet18", "vgg19_bn"],
                      metavar="{" + ",".join(choices()["model"]) + "}",
                      help="one or more of the models, or your ModelSpec as PATH.py:NAME")
    fact.add_argument("--width", type=float, default=1.0,
                      help="channel multiplier (images) / size multiplier (language models)")
    fact.add_argument("--rank-ratio", type=float, default=0.25,
                      help="rank as a fraction of each layer's full rank, in (0, 1]")
    fact.add_argument("--preset", default="paper",
                      help="the model's preset of layers kept full-rank, or 'none'")
    fact.add_argument("--image-size", type=int, default=32, help="32: CIFAR-10, 28: Fashion-MNIST")
    fact.add_argument("--in-channels", type=int, default=3,
                      help="image channels: 3 for CIFAR-10, 1 for Fashion-MNIST")
    fact.add_argument("--num-classes", type=int, default=10, help="outputs of the image models")
    fact.add_argument("--vocab-size", type=int, default=33278,
                      help="vocabulary of the language models")
    fact.add_argument("--threads", type=int, default=0,
                      help="torch threads (0: the CPUs other processes leave idle, at least 1)")
    fact.add_argument("--debug", action="store_true", help="show tracebacks")
    fact.set_defaults(run=_cmd_factorize)

    report = sub.add_parser("report", help="compare run directories side by side")
    report.add_argument("runs", nargs="+", help="run directories (the --out of `train`)")
    report.add_argument("--out", default=None,
                        help="write report.md and plots here (none: print the table only)")
    report.add_argument("--overwrite", action="store_true",
                        help="replace report files in --out that another command wrote")
    report.add_argument("--debug", action="store_true", help="show tracebacks")
    report.set_defaults(run=_cmd_report)

    compare = sub.add_parser(
        "compare", help="full-rank, Pufferfish, LTH and structured pruning at matched size",
        description="Trains each method on the same data and schedule (one run directory each "
                    "under --out, resumed if run again), then writes compare.md, compare.json, "
                    "tradeoff.png and report.md there. Training options as for `train`.")
    compare.add_argument("--config", help=CONFIG_HELP)
    compare.add_argument("--out", default=None, help="directory of the runs and the report "
                                                     "(default: runs/compare-<model>)")
    compare.add_argument("--methods", default="full,pufferfish,lth,prune",
                         help="comma-separated subset of full,pufferfish,lth,prune")
    compare.add_argument("--also-matched-pufferfish", action="store_true",
                         help="also train Pufferfish at the pruned model's parameter count")
    compare.add_argument("--workers", type=int, default=1,
                         help="processes per run (>1: each run under torchrun, DDP)")
    compare.add_argument("--latency-repeats", type=int, default=20,
                         help="timed forward passes at batch 1 (a quarter of them at batch 128)")
    compare.add_argument("--latency", action=argparse.BooleanOptionalAction, default=True,
                         help="time inference of the final models on this CPU")
    compare.add_argument("--debug", action="store_true", help="show tracebacks")
    _config_flags(compare, skip=("mode", "out", "resume"))
    compare.set_defaults(run=_cmd_compare)

    bench = sub.add_parser("bench", help="time each method's DDP (or FSDP2: --parallel fsdp) "
                                         "steps over real and emulated links; project to more "
                                         "workers (--train: accuracy against time)",
                           description="Writes results.json, results.md and plots into --out.")
    add_bench_arguments(bench)
    bench.add_argument("--debug", action="store_true", help="show tracebacks")
    bench.set_defaults(run=_cmd_bench)
    return parser


def _config_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...]) -> None:
    """A ``--flag`` for every TrainConfig field (as ``train`` has), except those in ``skip``,
    listed by concern: one argument group per TOML table of the option groups.

    Its help is the field's one line in its option group (``name: type = default  # help``), its
    allowed names (or type) and its default: nothing to write here for a new field.
    """
    named = choices()
    for section, keys in sections().items():
        group = parser.add_argument_group(f"{section} options (a --config file's [{section}])")
        for name in keys:
            if name not in skip:
                _config_flag(group, name, named)


def _config_flag(group: argparse._ArgumentGroup, name: str,
                 named: dict[str, tuple[str, ...]]) -> None:
    f = FIELDS[name]
    kind = field_kind(name)
    flag = "--" + name.replace("_", "-")
    text = field_description(name).replace("%", "%%")  # argparse %-formats help
    if kind is bool:
        group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                           default=None, help=f"{text} (default: {_on_off(f.default)})")
    elif kind is list:  # a list default comes from a factory; shown as it would be typed
        default = f.default_factory()  # type: ignore[misc]
        group.add_argument(flag, dest=name, default=None, metavar="LIST",
                           help=f"{text}; comma-separated (default: "
                                f"'{','.join(map(str, default))}')".replace("%", "%%"))
    else:
        metavar = "{" + ",".join(named[name]) + "}" if name in named else kind.__name__.upper()
        shown = repr(f.default).replace("%", "%%")
        group.add_argument(flag, dest=name, default=None, metavar=metavar,
                           help=f"{text} (default: {shown})")


def _on_off(value: object) -> str:
    return "on" if value else "off"


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default (unless it already says it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not action.option_strings or "(default" in text or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._StoreTrueAction | argparse.BooleanOptionalAction) or \
                isinstance(action.default, bool):
            return f"{text} (default: {_on_off(action.default)})"
        if isinstance(action, argparse._StoreFalseAction):
            return f"{text} (default: off)"
        shown = " ".join(map(str, action.default)) if isinstance(action.default, list) \
            else action.default
        shown = "none" if shown is None else repr(shown) if shown == "" else \
            str(shown).replace("%", "%%")
        return f"{text} (default: {shown})"


def _model_defaults_epilog() -> str:
    """Each model's defaults and where they come from (a model spec's ``defaults_note``)."""
    notes = [spec.defaults_note for name in models.model_names()
             if (spec := models.get_spec(name)).defaults_note]
    return "model defaults (where no file or flag sets them): " + " ".join(notes) if notes else ""


class _ExamplesFormatter(_HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The top-level help: its epilog of examples printed as written."""


def _cmd_train(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {k: getattr(args, k) for k in FIELDS
                                 if getattr(args, k, None) is not None}
    if overrides.get("resume") and overrides["resume"] != "auto":
        # Continue a run: its saved configuration, then any flags given now (e.g. more epochs).

        saved = Path(overrides["resume"]) / "config.toml"
        if not saved.exists():
            raise ConfigError(f"--resume {overrides['resume']!r}: no config.toml there, not a run "
                              "directory")
        if args.config:  # read and checked like flags (a flag given too wins)
            overrides = {**read_config_file(args.config, skip=overrides), **overrides}
        overrides.setdefault("out", overrides["resume"])
        cfg = load_run_config(saved, overrides)
    else:
        cfg = load_config(args.config, overrides)  # a bad value is named first
        _refuse_bare_train(args.config, overrides)
        cfg, said = resolve_short_try(cfg, set(overrides))
        if said and os.environ.get("RANK", "0") == "0":
            print(said, flush=True)
    train(cfg)
    return 0


def _refuse_bare_train(config: str | None, given: dict[str, Any]) -> None:
    """``pufferfish train`` with neither a config nor a model nor a length: the defaults are
    hours of full-width ResNet-18 on a CPU, not what a first try means; say so and what to type."""
    if config or given.keys() & {"model", "epochs", "tokens_per_param", "resume"}:
        return
    raise ConfigError("no --config, --model or --epochs given: the defaults train full-width "
                      "ResNet-18 on all 55,000 Fashion-MNIST training images for 10 epochs "
                      "(hours on a CPU); choose one, e.g. a try of a few minutes: pufferfish "
                      "train --config resnet18_fashion --epochs 1 --train-subset 512 --width 0.25")


def _cmd_factorize(args: argparse.Namespace) -> int:
    for flag in ("width", "rank_ratio", "image_size", "in_channels", "num_classes", "vocab_size"):
        if not getattr(args, flag) > 0:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)} is invalid: "
                              "allowed > 0")
    if args.threads < 0:
        raise ConfigError(f"--threads {args.threads} is invalid: allowed >= 1, or 0 (the idle "
                          "CPUs)")
    torch.set_num_threads(args.threads or idle_cpus())
    for name in args.model:
        model = models.build_at_width(name, args.width, num_classes=args.num_classes,
                                      in_channels=args.in_channels, image_size=args.image_size,
                                      vocab_size=args.vocab_size)
        x = models.get_spec(name).sample_input(in_channels=args.in_channels,
                                               image_size=args.image_size)
        report = factorize(model, rank_ratio=args.rank_ratio,
                           preset=None if args.preset == "none" else args.preset, example_input=x)
        print(f"== {name} (width {args.width}, input {tuple(x.shape)}, rank ratio "
              f"{args.rank_ratio}, preset {args.preset})")
        print(report)
        print()
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {k: getattr(args, k) for k in FIELDS
                                 if getattr(args, k, None) is not None}
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    # The base configuration is checked as Pufferfish's only when Pufferfish is run.
    overrides["mode"] = "pufferfish" if "pufferfish" in methods else "full"
    cfg = load_config(args.config, overrides)
    if args.workers < 1 or args.latency_repeats < 1:
        raise ConfigError("--workers and --latency-repeats must be >= 1")
    out = args.out or f"runs/compare-{cfg.model}"
    print(compare(cfg, out, methods=methods, matched=args.also_matched_pufferfish,
                  workers=args.workers, repeats=args.latency_repeats, latency=args.latency))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    print(compare_runs(args.runs, args.out, overwrite=args.overwrite))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
