"""Faults on the draft -> target link, for the chaos suite: delay or drop blocks on their way
to the target. Off unless a test turns them on (``DraftWorker.inject_link_faults``); the
target then sees late or missing blocks, exactly as over a bad network, and must stay exact
(a block past its deadline is dropped and the round runs target-only)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class LinkFaults:
    delay_s: float = 0.0  # every block waits this long before it is sent
    drop_fraction: float = 0.0  # this share of blocks is never sent
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.delay_s, (int, float)) and 0 <= self.delay_s <= 60):
            raise ValueError(f"delay_s must be in [0, 60], got {self.delay_s!r}")
        if not (isinstance(self.drop_fraction, (int, float)) and 0 <= self.drop_fraction <= 1):
            raise ValueError(f"drop_fraction must be in [0, 1], got {self.drop_fraction!r}")
        self._rng = random.Random(self.seed)

    @property
    def active(self) -> bool:
        return self.delay_s > 0 or self.drop_fraction > 0

    def fate(self) -> float | None:
        """None: drop this block; else the seconds to hold it before sending."""
        if self.drop_fraction and self._rng.random() < self.drop_fraction:
            return None
        return self.delay_s
