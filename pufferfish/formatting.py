"""How pufferfish writes text for people: one-line messages and Markdown tables.

Every error the CLI prints and every report table goes through these two functions, so a
message never spans lines and every table has the same shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["markdown_table", "one_line"]


def one_line(message: str | BaseException, *, limit: int | None = None,
             with_type: bool = False) -> str:
    """``message`` with its whitespace (newlines included) collapsed to single spaces.

    An exception gives its text, or its type's name when the text is empty (``with_type``
    prefixes the type name anyway: "OSError: ..."). ``limit`` cuts the result to that many
    characters, ending in "...".
    """
    text = " ".join(str(message).split())
    if isinstance(message, BaseException):
        name = type(message).__name__
        text = f"{name}: {text}" if with_type and text else text or name
    if limit is not None and len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """The lines of a Markdown table: ``head``, the separator, one line per row (cells as str)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines
