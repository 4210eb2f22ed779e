"""How many cases each fuzz test runs, and the record of what it ran.

``SPECRAY_FUZZ_EXAMPLES=N`` runs every fuzz test with N examples instead of its own small
default (``make test`` keeps the defaults; ``make chaos`` sets a large N).
``SPECRAY_FUZZ_REPORT=path`` appends one JSON line per fuzz test to ``path``:
``{"test": nodeid, "cases": N, "5xx": M}``; the chaos report sums them. ``cases`` counts the
examples actually run (Hypothesis may stop early when a strategy runs out of new inputs, and
runs more while it shrinks a failure); ``5xx`` counts server faults seen: HTTP 5xx other than
the documented 504 of a request's own ``timeout``, gRPC UNKNOWN / INTERNAL. It includes the
faults of the known bugs the tests mark (the tests fail on any other).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, settings

EXAMPLES_ENV = "SPECRAY_FUZZ_EXAMPLES"
REPORT_ENV = "SPECRAY_FUZZ_REPORT"


def examples(default: int) -> int:
    """The example count of one fuzz test: ``default``, or the env override."""
    raw = os.environ.get(EXAMPLES_ENV, "").strip()
    if not raw:
        return default
    if not raw.isdecimal() or int(raw) < 1:
        raise ValueError(f"{EXAMPLES_ENV} must be an integer >= 1, got {raw!r}")
    return int(raw)


def fuzz_settings(default_examples: int) -> settings:
    """Deterministic Hypothesis settings: ``examples(default_examples)`` cases, the seed derived
    from the test's name (``derandomize``), no example database, no per-case deadline (a case
    may wait on a real server)."""
    return settings(
        max_examples=examples(default_examples),
        derandomize=True,
        database=None,
        deadline=None,
        print_blob=False,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],  # "explain" costs minutes
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,  # the tally counts across examples on purpose
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )


@dataclass
class Tally:
    """Cases run and server errors seen by one fuzz test."""

    test: str
    cases: int = 0
    server_errors: int = 0

    def case(self) -> None:
        self.cases += 1

    def server_error(self) -> None:
        self.server_errors += 1

    def record(self) -> None:
        """Append this test's line to ``$SPECRAY_FUZZ_REPORT`` (nothing when unset)."""
        path = os.environ.get(REPORT_ENV)
        if not path:
            return
        line = {"test": self.test, "cases": self.cases, "5xx": self.server_errors}
        with open(path, "a", encoding="utf-8") as report:
            report.write(json.dumps(line) + "\n")
