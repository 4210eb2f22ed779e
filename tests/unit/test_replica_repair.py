"""The window in which a Serve replica replacing its own dead actors reports itself healthy."""

from __future__ import annotations

import time

from specray.serve.deployments import Repair


def test_a_repair_is_healthy_until_it_ends_or_times_out():
    repair = Repair(timeout_s=0.2)
    assert not repair.under_way()  # nothing to repair: the health check runs
    repair.begin()
    assert repair.under_way()
    repair.end()
    assert not repair.under_way()

    repair.begin()
    first = repair.since
    time.sleep(0.12)
    repair.begin()  # a failed attempt retried keeps the first attempt's clock
    assert repair.since == first and repair.under_way()
    time.sleep(0.12)
    assert not repair.under_way()  # past the timeout: Serve may replace the replica
