"""``--help`` explains: every option of every subcommand has a description and shows its
default, and the train options' help comes from TrainConfig's one line per field."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import pytest

from pufferfish.cli import _HelpFormatter, _parser
from pufferfish.config import TrainConfig
from pufferfish.configfile import FIELDS, field_description
from pufferfish.fieldhelp import field_help


def _commands() -> dict[str, argparse.ArgumentParser]:
    for action in _parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_option_has_a_description_and_its_default(command: str) -> None:
    parser = _commands()[command]
    formatter = _HelpFormatter(prog="pufferfish")
    bare = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        text = formatter._get_help_string(action) or ""
        description = text.split("(default")[0].strip()
        if len(description) < 8 or "(default: " not in text:
            bare.append(f"{action.option_strings[0]}: {text!r}")
    assert not bare, f"pufferfish {command}: options without a description or default: {bare}"
    parser.format_help()  # renders (no stray % in any help)


def test_train_help_is_the_field_comment_and_lists_the_allowed_names() -> None:
    assert set(FIELDS) <= {n for n in FIELDS if field_description(n)}
    help_text = _commands()["train"].format_help()
    assert "--schedule {multistep,cosine,constant}" in help_text
    assert "--comm {allreduce,fp16,powersgd,signum,topk}" in help_text
    assert field_help(TrainConfig)["epochs"] == "passes over the training data"


def test_field_help_reads_trailing_comments_only() -> None:
    @dataclass
    class Example:
        # a section comment is not a field's help
        plain: int = 1
        hashed: str = "#not-a-comment"  # the real help
        listed: list[int] = dataclasses.field(default_factory=list)  # several values

        def method(self) -> None:
            inner: int = 3  # not a field
            del inner

    assert field_help(Example) == {"hashed": "the real help", "listed": "several values"}
