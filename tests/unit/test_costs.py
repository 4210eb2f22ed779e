"""The coordinator's cost tracking: calibrated tables keep their shape, their level follows
the rounds observed in service, and the run's mean level is what a simulation of it uses."""

import pytest

from specray.cluster.costs import REFIT_EVERY, Costs, scaled
from specray.cluster.policy import DraftCost, VerifyCost

VERIFY = VerifyCost(0.0, 0.0, 0.0, table=((1, 0.05), (8, 0.06), (64, 0.2)))
DRAFT = DraftCost(0.0, 0.0, table=((1, 0.003), (16, 0.02)))


def test_calibrated_tables_follow_the_observed_level_and_keep_their_shape():
    costs = Costs(VERIFY, DRAFT, 0.002)
    for _ in range(4 * REFIT_EVERY):  # every round observed 1.5x the calibrated time
        costs.add_verify(4, 2, 1.5 * VERIFY.seconds(4, 2), VERIFY)
    assert costs.verify_level == pytest.approx(1.5, rel=1e-3)
    assert costs.verify.seconds(8, 8) == pytest.approx(1.5 * VERIFY.seconds(8, 8), rel=1e-3)
    assert costs.mean_verify_level == pytest.approx(1.5)
    assert costs.mean_draft_level == 1.0  # nothing observed: the calibration as it is


def test_mean_level_weighs_the_whole_run_while_the_running_level_follows_its_end():
    costs = Costs(VERIFY, DRAFT, 0.002)
    for _ in range(30):
        costs.add_draft(1, 2.0 * DRAFT.seconds(1), DRAFT)
    for _ in range(30):
        costs.add_draft(16, 1.0 * DRAFT.seconds(16), DRAFT)
    assert costs.draft_level == pytest.approx(1.0, abs=1e-2)
    # Seconds-weighted: 30 steps at 2 x 3 ms and 30 at 1 x 20 ms -> (0.18 + 0.6) / (0.09 + 0.6).
    assert costs.mean_draft_level == pytest.approx(0.78 / 0.69)


def test_scaled_multiplies_every_point():
    assert scaled(DRAFT, 2.0).table == ((1.0, 0.006), (16.0, 0.04))
