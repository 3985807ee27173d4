"""The help text of a configuration dataclass's fields: the trailing comment of each field.

A configuration class is the one place an option is defined, in one line that the ``--help``
of every command taking it shows::

    epochs: int = 10  # passes over the training data

so a field added in that style has its help with nothing else to edit. Read from the source
with :mod:`tokenize`, so a ``#`` inside a string default is not a comment.
"""

from __future__ import annotations

import functools
import inspect
import io
import tokenize

__all__ = ["field_help"]


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """``{field name: its trailing comment}`` for the fields of ``cls`` (and its bases) that have
    one; empty when the source cannot be read (an installation without ``.py`` files)."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):  # bases first, the class's own comments win
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        found.update(_trailing_comments(source))
    return found


def _trailing_comments(source: str) -> dict[str, str]:
    """``name: annotation = default  # help`` lines at the class body's indentation."""
    found: dict[str, str] = {}
    line: list[tokenize.TokenInfo] = []
    body_col: int | None = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER):
            code = [t for t in line if t.type not in (tokenize.INDENT, tokenize.DEDENT)]
            if (len(code) >= 3 and code[0].type == tokenize.NAME and code[1].string == ":"
                    and code[-1].type == tokenize.COMMENT):
                if body_col is None:
                    body_col = code[0].start[1]
                if code[0].start[1] == body_col:
                    found[code[0].string] = code[-1].string.lstrip("#").strip()
            line = []
        else:
            line.append(tok)
    return found
