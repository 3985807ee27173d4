"""The record of one ``factorize`` call: a decision per module, with its reason, and the counts.

``format_table`` lays out its text form (and the switch's, which adds the automatic choices).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["FactorizationReport", "LayerDecision", "format_table"]


@dataclass
class LayerDecision:
    """What ``factorize`` did with one module, and why."""

    name: str
    kind: str
    shape: str
    factorized: bool
    reason: str
    rank: int | None = None
    full_rank: int | None = None
    params_before: int = 0
    params_after: int = 0
    aliases: list[str] = field(default_factory=list)


@dataclass
class FactorizationReport:
    """Per-module decisions plus whole-model parameter (and, given an input, MAC) counts."""

    layers: list[LayerDecision]
    params_before: int
    params_after: int
    macs_before: int | None = None
    macs_after: int | None = None

    @property
    def factorized(self) -> list[LayerDecision]:
        return [d for d in self.layers if d.factorized]

    @property
    def ranks(self) -> dict[str, int]:
        """Qualified name -> rank of every factorized module (what a checkpoint must record)."""
        return {d.name: d.rank for d in self.layers if d.factorized and d.rank is not None}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        rows = [("module", "type", "shape", "rank", "params", "decision")]
        for d in self.layers:
            rank = f"{d.rank}/{d.full_rank}" if d.factorized else "-"
            params = (f"{d.params_before:,} -> {d.params_after:,}" if d.factorized
                      else f"{d.params_before:,}")
            name = d.name + (f" (= {', '.join(d.aliases)})" if d.aliases else "")
            rows.append((name, d.kind, d.shape, rank, params, d.reason))
        lines = format_table(rows)
        ratio = self.params_before / max(1, self.params_after)
        lines.append(f"parameters: {self.params_before:,} -> {self.params_after:,} ({ratio:.2f}x fewer)")
        if self.macs_before is not None and self.macs_after is not None:
            ratio = self.macs_before / max(1, self.macs_after)
            lines.append(f"MACs:       {self.macs_before:,} -> {self.macs_after:,} ({ratio:.2f}x fewer)")
        return "\n".join(lines)


def format_table(rows: list[tuple[str, ...]], indent: str = "") -> list[str]:
    """Aligned plain-text columns, a dashed rule under the header row (the first)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, indent + "  ".join("-" * w for w in widths))
    return lines
