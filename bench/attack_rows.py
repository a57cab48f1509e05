"""The row every attack reports, whichever module ran it, and the one table that prints rows.

The drill's own attacks (bench/attack_drill.py), the structured-output ones
(bench/attacks_grammar.py) and the model-file ones (bench/attacks_modelfiles.py) all return
`AttackRow`s. An attack fills in what it saw from the client side (and, run on its own, what it
measured: /health, RSS, survival); the drill measures the rest around each call and fills it in.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class AttackRow:
    attack: str  # short name, e.g. "h2 ping flood"
    statuses: Counter[str] = field(default_factory=Counter)  # "413", "goaway", "refused", ...
    detail: str = ""  # one line: what the attacker achieved, or the defence that met it
    rss_growth_mb: float | None = None  # filled by the drill
    health_p_max_s: float | None = None  # slowest /health during the attack (drill)
    health_failures: int = 0  # /health probes that failed or took over 1 s (drill)
    survived: bool | None = None  # the daemon's process still running afterwards (drill)
    others_ok: bool | None = None  # a normal client's request completed meanwhile (drill)

    def status_text(self) -> str:
        return " ".join(f"{code}x{n}" for code, n in sorted(self.statuses.items())) or "-"

    @property
    def passed(self) -> bool:
        """The issue's bar: survived, /health within 1 s, RSS within 500 MB, others served."""
        return (
            self.survived is not False
            and self.health_failures == 0
            and (self.rss_growth_mb is None or self.rss_growth_mb <= 500)
            and self.others_ok is not False
        )


def print_rows(rows: list[AttackRow], file: TextIO = sys.stdout) -> None:
    """The table: one line an attack, its detail last."""
    header = (
        "attack",
        "statuses",
        "RSS +MB",
        "/health max s",
        "others",
        "survived",
        "ok",
        "detail",
    )
    lines = [header]
    for r in rows:
        lines.append((
            r.attack, r.status_text(),
            "-" if r.rss_growth_mb is None else f"{r.rss_growth_mb:.0f}",
            "-" if r.health_p_max_s is None else f"{r.health_p_max_s:.3f}",
            {None: "-", True: "ok", False: "FAILED"}[r.others_ok],
            {None: "-", True: "yes", False: "NO"}[r.survived],
            "PASS" if r.passed else "FAIL", r.detail,
        ))  # fmt: skip
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header) - 1)]
    for line in lines:
        print(
            "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=False))
            + "  "
            + line[-1],
            file=file,
        )
