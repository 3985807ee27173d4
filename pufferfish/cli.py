"""The ``pufferfish`` command line: argument parsing only; every command calls into the library.

Bad input of any kind (flags, config files, data files, checkpoints) ends the command with a
one-line ``pufferfish: error: ...`` on stderr and exit status 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from .config import FIELDS, ConfigError, field_kind

__all__ = ["main"]

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("pufferfish: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if getattr(args, "debug", False) or not _is_user_error(e):
            raise
        print(f"pufferfish: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE


def _is_user_error(e: Exception) -> bool:
    from .data import DataError
    from .training.checkpoint import CheckpointError
    from .training.loop import TrainingError

    return isinstance(e, ConfigError | DataError | CheckpointError | TrainingError | ValueError
                      | FileNotFoundError)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pufferfish",
        description="Communication-efficient distributed training with pre-factorized low-rank "
                    "networks (Pufferfish, MLSys 2021).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser("train", help="train a model (one process, or under torchrun: DDP)",
                           description="Every option is also a key of the --config TOML file; "
                                       "flags override the file.")
    train.add_argument("--config", help="TOML file of training options")
    train.add_argument("--debug", action="store_true", help="show tracebacks")
    for name, f in FIELDS.items():
        kind = field_kind(name)
        flag = "--" + name.replace("_", "-")
        default_text = f.default if f.default is not f.default_factory else "[]"  # type: ignore[misc]
        if kind is bool:
            train.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                               default=None, help=f"(default: {default_text})")
        else:
            train.add_argument(flag, dest=name, default=None, metavar=kind.__name__.upper(),
                               help=f"(default: {default_text!r})" + (
                                   ", comma-separated" if kind is list else ""))
    train.set_defaults(run=_cmd_train)

    fact = sub.add_parser("factorize", help="factorize a paper model and print the report")
    fact.add_argument("--model", nargs="+", default=["resnet18", "vgg19_bn"],
                      help="resnet18, vgg19_bn, lstm, transformer")
    fact.add_argument("--width", type=float, default=1.0)
    fact.add_argument("--rank-ratio", type=float, default=0.25)
    fact.add_argument("--preset", default="paper", help="the model's preset, or 'none'")
    fact.add_argument("--image-size", type=int, default=32, help="32: CIFAR-10, 28: Fashion-MNIST")
    fact.add_argument("--in-channels", type=int, default=3)
    fact.add_argument("--num-classes", type=int, default=10)
    fact.add_argument("--vocab-size", type=int, default=33278, help="for the language models")
    fact.add_argument("--debug", action="store_true")
    fact.set_defaults(run=_cmd_factorize)

    report = sub.add_parser("report", help="compare run directories side by side")
    report.add_argument("runs", nargs="+", help="run directories")
    report.add_argument("--out", default=None, help="write report.md and plots here")
    report.add_argument("--debug", action="store_true")
    report.set_defaults(run=_cmd_report)
    return parser


def _cmd_train(args: argparse.Namespace) -> int:
    from .config import load_config
    from .training.loop import train

    overrides: dict[str, Any] = {k: getattr(args, k) for k in FIELDS
                                 if getattr(args, k, None) is not None}
    config = args.config
    if overrides.get("resume"):
        # Continue a run: its saved configuration, then any flags given now (e.g. more epochs).
        from pathlib import Path

        saved = Path(overrides["resume"]) / "config.toml"
        if not saved.exists():
            raise ConfigError(f"--resume {overrides['resume']!r}: no config.toml there, not a run "
                              "directory")
        config = saved
        overrides.setdefault("out", overrides["resume"])
    cfg = load_config(config, overrides)
    train(cfg)
    return 0


def _cmd_factorize(args: argparse.Namespace) -> int:
    import torch

    from . import factorize, models

    for name in args.model:
        if name in ("lstm", "transformer"):
            dim = round((1500 if name == "lstm" else 256) * args.width)
            kw = ({"embed_dim": dim, "hidden_size": dim} if name == "lstm" else {"d_model": dim})
            model = models.build_model(name, vocab_size=args.vocab_size, **kw)
            x = torch.zeros((35, 1) if name == "lstm" else (1, 35), dtype=torch.long)
        else:
            model = models.build_model(name, num_classes=args.num_classes,
                                       in_channels=args.in_channels, width=args.width,
                                       image_size=args.image_size)
            x = torch.zeros(1, args.in_channels, args.image_size, args.image_size)
        report = factorize(model, rank_ratio=args.rank_ratio,
                           preset=None if args.preset == "none" else args.preset, example_input=x)
        print(f"== {name} (width {args.width}, input {tuple(x.shape)}, rank ratio "
              f"{args.rank_ratio}, preset {args.preset})")
        print(report)
        print()
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from .training.report import compare_runs

    print(compare_runs(args.runs, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
