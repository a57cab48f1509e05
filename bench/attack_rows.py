"""The row every attack of bench/attack_drill.py reports, whichever module ran it.

Attack modules (bench/attacks_*.py) expose functions taking `(base_url, api_key)` (or
`admin_key` for model loads) and returning a list of `AttackRow`. They fill in what they saw
from the client side; the drill measures the rest (RSS, /health latency, survival) around
each call and merges it in with `dataclasses.replace`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


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
