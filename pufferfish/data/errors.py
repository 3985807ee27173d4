"""The single exception type for every bad-input problem in :mod:`pufferfish.data`."""

from __future__ import annotations


class DataError(ValueError):
    """Bad or missing input data.

    Subclasses ``ValueError`` so generic callers still catch it; messages are one line and
    name the offending file/value plus what was expected, so a CLI can print them verbatim.
    """
