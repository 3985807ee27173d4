"""Links as users type them (``100mbit``, ``100mbit@20ms``) and rates as the bench prints them
(``94.1 Mbit/s``).

Its own small module: the config, the link, the probe and every report read rates.
"""

from __future__ import annotations

import re

__all__ = ["LINK_FORM", "MAX_DELAY_MS", "TORCHRUN_LINK", "format_bps", "parse_bandwidth",
           "parse_link"]

TORCHRUN_LINK = "torchrun"  # the link of a bench under torchrun: its processes' own (launched.py)

_BW_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(k|m|g|t)?(bit|bps)\s*$", re.IGNORECASE)
_BW_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BW_FORM = (
    "'loopback' or <number><unit> with unit in bit/kbit/mbit/gbit/tbit (e.g. '100mbit', '1gbit')"
)
_DELAY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|us)\s*$", re.IGNORECASE)
MAX_DELAY_MS = 1000.0  # one second each way: beyond any real link (geostationary: ~280 ms)
LINK_FORM = ("RATE or RATE@DELAY: RATE as '100mbit' (or 'loopback', without a delay), DELAY the "
             f"one-way latency in ms or us, 0 to {MAX_DELAY_MS:g}ms (e.g. '100mbit@20ms')")


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


def parse_link(text: str) -> tuple[int | None, float]:
    """One ``--bandwidth`` entry as ``(bits per second or None for loopback, one-way delay ms)``.

    ``"100mbit@20ms"`` is a 100 Mbit/s link whose packets wait 20 ms each way (``netem delay``
    on both veth ends: a round trip of 40 ms), as a real slow link has; ``"100mbit"`` has none.
    Loopback cannot be delayed (no link is emulated). ``ValueError`` (one line) names the entry,
    ``--bandwidth`` and :data:`LINK_FORM`.
    """
    if not isinstance(text, str):
        raise ValueError(f"--bandwidth entry {text!r} is invalid: allowed {LINK_FORM}")
    rate_text, sep, delay_text = text.partition("@")
    try:
        rate = parse_bandwidth(rate_text)
    except ValueError as e:
        raise ValueError(f"--bandwidth entry {text!r} is invalid: {e}") from None
    if not sep:
        return rate, 0.0
    if rate is None:
        raise ValueError(f"--bandwidth entry {text!r} is invalid: loopback has no emulated link "
                         f"to delay; allowed {LINK_FORM}")
    m = _DELAY_RE.match(delay_text)
    delay_ms = float(m.group(1)) / (1000.0 if m.group(2).lower() == "us" else 1.0) if m else -1.0
    if m is None or delay_ms > MAX_DELAY_MS:
        raise ValueError(f"--bandwidth entry {text!r} is invalid: allowed {LINK_FORM}")
    return rate, delay_ms


def format_bps(bps: float) -> str:
    """Human-readable bits/s (``94.1 Mbit/s``) for benchmark output."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.1f} {unit}"
    return f"{bps:.0f} bit/s"

