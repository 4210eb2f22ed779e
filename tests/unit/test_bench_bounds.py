"""The performance model's bounds at concurrency 1 (docs/design.md section 5), as the serving
benchmark computes them from a row's acceptance and the calibrated costs."""

from __future__ import annotations

import pytest

from specray.bench.serving import one_request_bound, pipelined_bound
from specray.engine_core.policy import DraftCost, VerifyCost

# A 40 ms target step, verifying 3 tokens 1.2x a step, a 6 ms draft step (c = 0.15).
VERIFY = VerifyCost(0.0, 0.0, 0.0, table=((1, 0.040), (3, 0.048)))
DRAFT = DraftCost(0.006, 0.0)
CALIBRATION = (VERIFY, DRAFT)


def row(mean_acceptance_length: float, rtt_s: float = 0.0) -> dict:
    return {"mean_k": 2.0, "mean_acceptance_length": mean_acceptance_length, "rtt_s": rtt_s}


def test_no_draft_ahead_survives_at_zero_acceptance():
    """α = 0: every block is rejected, so the next is always drafted after the verdict."""
    v, d = 0.048 / 0.040, 2 * 0.006 / 0.040
    assert one_request_bound(row(1.0), CALIBRATION) == pytest.approx(1 / (v + d), rel=1e-6)
    assert pipelined_bound(row(1.0), CALIBRATION) == pytest.approx(1 / v, rel=1e-6)


def test_full_acceptance_reaches_the_pipelined_bound():
    one, pipelined = (
        one_request_bound(row(3.0), CALIBRATION),
        pipelined_bound(row(3.0), CALIBRATION),
    )
    assert one == pytest.approx(pipelined, rel=1e-6)
    assert pipelined == pytest.approx(3.0 / (0.048 / 0.040), rel=1e-6)


@pytest.mark.parametrize("mean_length", [1.2, 1.5, 1.75, 2.2, 2.8])
def test_one_request_bound_sits_between_the_synchronous_and_pipelined_bounds(mean_length):
    r = row(mean_length, rtt_s=0.001)
    one, pipelined = one_request_bound(r, CALIBRATION), pipelined_bound(r, CALIBRATION)
    v, d = (0.048 + 0.001) / 0.040, 2 * 0.006 / 0.040
    synchronous = mean_length / (v + d)
    assert synchronous < one < pipelined


def test_a_mix_of_block_lengths_is_bounded_over_its_mix_not_its_rounded_mean():
    """Half the rounds at K = 1, half at K = 2 (mean 1.5): E and the round's cost are both
    averaged over the two, not taken at K = round(1.5)."""
    verify = VerifyCost(0.0, 0.0, 0.0, table=((1, 0.040), (2, 0.044), (3, 0.048)))
    calibration = (verify, DRAFT)
    mixed = {
        "mean_k": 1.5,
        "mean_acceptance_length": 1.5,
        "rtt_s": 0.0,
        "verdicts_by_k": [3, 10, 10],  # (rounds without a draft are not draft rounds)
    }
    v1, v2 = 0.044 / 0.040, 0.048 / 0.040
    assert pipelined_bound(mixed, calibration) == pytest.approx(1.5 / ((v1 + v2) / 2), rel=1e-6)
    rounded = {key: value for key, value in mixed.items() if key != "verdicts_by_k"}
    assert pipelined_bound(rounded, calibration) == pytest.approx(1.5 / v2, rel=1e-6)
    # α solves (1 + α) / 2 + (1 + α + α²) / 2 = 1.5, and drafts made ahead at K are kept with
    # probability α^(K+1).
    alpha = (-2 + (4 + 4 * 1.0) ** 0.5) / 2  # α² + 2α - 1 = 0
    d1, d2 = 0.006 / 0.040, 2 * 0.006 / 0.040
    cost = sum(
        (alpha ** (k + 1) * max(v, d) + (1 - alpha ** (k + 1)) * (v + d)) / 2
        for k, v, d in ((1, v1, d1), (2, v2, d2))
    )
    assert one_request_bound(mixed, calibration) == pytest.approx(1.5 / cost, rel=1e-6)


def test_rounds_without_a_draft_count_at_their_own_cost_over_all_rounds():
    """A third of the rounds at K = 0 (the policy chose not to draft), the rest at K = 2 with
    a mean acceptance length of 1.75 (α = 0.5). Over draft rounds the bound is E_2 / V_2; over
    all rounds a K = 0 round adds one token at a verification of one, measured without the
    drafted rounds' extra slowness (``draft_round_scale``)."""
    r = {
        "mean_k": 4 / 3,
        "mean_acceptance_length": 1.75,
        "rtt_s": 0.0,
        "verdicts_by_k": [10, 0, 20],
        "verify_level": 1.1,
        "draft_round_scale": 1.2,
        "draft_level": 1.0,
    }
    target_only = {"verify_level": 1.0}
    v0, v2 = 1.1, 0.048 / 0.040 * 1.1 * 1.2
    drafted = pipelined_bound(r, CALIBRATION, target_only)
    over_all = pipelined_bound(r, CALIBRATION, target_only, all_rounds=True)
    assert drafted == pytest.approx(1.75 / v2, rel=1e-6)
    assert over_all == pytest.approx((1 / 3 + 2 / 3 * 1.75) / (1 / 3 * v0 + 2 / 3 * v2), rel=1e-6)
    # Without rounds at K = 0 the two are the same bound.
    r["verdicts_by_k"] = [0, 0, 20]
    assert pipelined_bound(r, CALIBRATION, target_only, all_rounds=True) == pytest.approx(
        pipelined_bound(r, CALIBRATION, target_only), rel=1e-12
    )
