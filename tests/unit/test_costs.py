"""The coordinator's cost tracking: calibrated tables keep their shape, their level follows
the rounds observed in service, and the run's mean level is what a simulation of it uses."""

import pytest

from specray.engine_core.costs import REFIT_EVERY, Costs, scaled
from specray.engine_core.policy import DraftCost, PolicyConfig, VerifyCost, choose_k

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


def test_rounds_verifying_drafts_keep_their_own_level():
    """Target-only rounds observed at 1.2x their calibrated forward, rounds verifying drafts
    at 1.5x: the table follows the first, and draft rounds cost 1.25x more on top."""
    costs = Costs(VERIFY, DRAFT, 0.002)
    for _ in range(4 * REFIT_EVERY):
        costs.add_verify(4, 1, 1.2 * VERIFY.seconds(4, 1), VERIFY)
        costs.add_verify(4, 3, 1.5 * VERIFY.seconds(4, 3), VERIFY)
    assert costs.verify_level == pytest.approx(1.2, rel=1e-3)
    assert costs.draft_round_scale == pytest.approx(1.25, rel=1e-3)
    assert costs.verify.seconds(16, 1) == pytest.approx(1.2 * VERIFY.seconds(16, 1), rel=1e-3)
    assert costs.verify.seconds(8, 5) == pytest.approx(1.5 * VERIFY.seconds(8, 5), rel=1e-3)
    assert costs.mean_levels == pytest.approx((1.2, 1.25))


def test_draft_round_scale_is_validated_and_moves_the_policy():
    with pytest.raises(ValueError, match="draft_round_scale"):
        VerifyCost(0.01, 0.0, 0.0, draft_round_scale=0.0)
    # α = 0.6 at batch 4, verify 10 ms + 1 ms per token, a 1 ms draft step: speculation pays
    # by 18% at scale 1 (k = 1: 4 * 1.6 / 19 ms against 4 / 14 ms); 30% dearer draft rounds
    # (23.4 ms for that forward) make it lose.
    line = VerifyCost(0.010, 0.0, 0.001)
    kwargs = dict(batch=4, draft=DraftCost(0.001, 0.0), rtt_s=0.0, pipelined=False)
    config = PolicyConfig()
    assert choose_k([0.6], verify=line, config=config, **kwargs) > 0
    dear = VerifyCost(0.010, 0.0, 0.001, draft_round_scale=1.3)
    assert choose_k([0.6], verify=dear, config=config, **kwargs) == 0


def test_a_group_start_calibration_becomes_the_verify_table():
    """What a served target group times when it starts (START_CALIBRATION_GRID on its runner)
    is the policy's verify cost: a table over the tokens in a forward, non-decreasing, that
    answers each timed point with at most its time (the cheapest at or above its count)."""
    from specray.cluster.distributed import START_CALIBRATION_GRID, verify_cost_table
    from specray.models.runner import ModelRunner
    from tests.helpers.tiny_models import tiny_llama

    runner = ModelRunner(tiny_llama(5, seed=0))
    measured = [(b, n, runner.time_forward(b, n)) for b, n in START_CALIBRATION_GRID]
    verify = verify_cost_table(measured)
    counts = [tokens for tokens, _ in verify.table]
    assert counts == sorted({b * n for b, n, _ in measured})
    seconds = [s for _, s in verify.table]
    assert all(s > 0 for s in seconds) and seconds == sorted(seconds)
    for batch, tokens, timed in measured:
        assert verify.seconds(batch, tokens) <= timed
