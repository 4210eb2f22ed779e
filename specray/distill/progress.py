"""A plain-text progress line with rate and ETA (stderr; one line per update when not a tty)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, phase: str, total: int, unit: str, *, start: int = 0, every_s: float = 10.0):
        self.phase, self.total, self.unit = phase, total, unit
        self.done = start
        self._first = start
        self._started = time.monotonic()
        self._last_print = 0.0
        self._every_s = every_s

    def update(self, amount: int, extra: str = "") -> None:
        self.done += amount
        now = time.monotonic()
        if now - self._last_print >= self._every_s or self.done >= self.total:
            self._last_print = now
            self.print(extra)

    def print(self, extra: str = "") -> None:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        rate = (self.done - self._first) / elapsed
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = f"{left / 60:.1f} min" if left != float("inf") else "?"
        line = (
            f"distill {self.phase}: {self.done}/{self.total} {self.unit} "
            f"({100 * self.done / max(self.total, 1):.0f}%), {rate:.1f} {self.unit}/s, "
            f"elapsed {elapsed / 60:.1f} min, ETA {eta}"
        )
        print(line + (f", {extra}" if extra else ""), file=sys.stderr, flush=True)
