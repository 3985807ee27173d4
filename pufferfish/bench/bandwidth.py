"""Link rates as users type them (``100mbit``) and as the bench prints them (``94.1 Mbit/s``).

Its own small module: the config, the link, the probe and every report read rates.
"""

from __future__ import annotations

import re

__all__ = ["format_bps", "parse_bandwidth"]

_BW_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(k|m|g|t)?(bit|bps)\s*$", re.IGNORECASE)
_BW_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BW_FORM = (
    "'loopback' or <number><unit> with unit in bit/kbit/mbit/gbit/tbit (e.g. '100mbit', '1gbit')"
)



def parse_bandwidth(text: str) -> int | None:
    """Parse a link rate as used on the command line into bits per second.

    ``"loopback"`` (aliases ``lo``/``none``/``unlimited``) means "no emulation" and
    returns ``None``; ``"100mbit"``,
    ``"1gbit"``, ``"500kbit"``, ``"10gbit"`` (tc's decimal units, case-insensitive)
    return integers.  ``"100mbps"`` is rejected on purpose: tc reads ``bps`` as
    *bytes* per second, so accepting it either way would invite an 8x mistake.
    """
    if not isinstance(text, str):
        raise ValueError(f"invalid bandwidth {text!r}: expected {_BW_FORM}")
    s = text.strip().lower()
    if s in ("loopback", "lo", "none", "unlimited"):
        return None
    m = _BW_RE.match(s)
    if m is not None and m.group(3).lower() == "bps":
        raise ValueError(
            f"invalid bandwidth {text!r}: 'bps' is ambiguous (tc reads it as bytes/s); "
            f"expected {_BW_FORM}"
        )
    if m is None:
        raise ValueError(f"invalid bandwidth {text!r}: expected {_BW_FORM}")
    value = float(m.group(1)) * _BW_UNITS[(m.group(2) or "").lower()]
    bps = round(value)
    if bps < 8_000:
        # tbf cannot shape meaningfully below ~1 kB/s and gloo would time out anyway.
        raise ValueError(f"invalid bandwidth {text!r}: rate must be at least 8kbit ({_BW_FORM})")
    return bps


def format_bps(bps: float) -> str:
    """Human-readable bits/s (``94.1 Mbit/s``) for benchmark output."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.1f} {unit}"
    return f"{bps:.0f} bit/s"

