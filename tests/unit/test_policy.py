"""Speculation-length policy: E(k), round time, choice of k, cost fits, acceptance tracking."""

import math
import random
import re

import pytest

from specray.engine_core.cost_fit import fit_draft_cost, fit_verify_cost
from specray.engine_core.policy import (
    AcceptanceEstimator,
    DraftCost,
    PolicyConfig,
    VerifyCost,
    choose_batch_k,
    choose_k,
    draft_ahead_hit,
    expected_committed,
    predicted_tokens_per_s,
    should_draft_ahead,
    should_probe,
    tabulate,
)

# Target step at batch 4: 10.44 ms, growing only 0.04 ms per extra verified token.
VERIFY = VerifyCost(fixed_s=0.010, per_request_s=0.0001, per_token_s=0.00001)
CHEAP_DRAFT = DraftCost(fixed_s=0.0005, per_request_s=0.000005)  # 0.52 ms: 0.05x target step
MID_DRAFT = DraftCost(fixed_s=0.002, per_request_s=0.00002)  # 2.08 ms: 0.2x target step
EQUAL_DRAFT = DraftCost(fixed_s=0.010, per_request_s=0.00011)  # 10.44 ms: the target step
RTTS_S = (0.0002, 0.005, 0.050)


def pick(alpha, draft=CHEAP_DRAFT, *, rtt_s=0.0002, pipelined=False, batch=4, **config):
    return choose_k(
        [alpha],
        batch=batch,
        verify=VERIFY,
        draft=draft,
        rtt_s=rtt_s,
        pipelined=pipelined,
        config=PolicyConfig(**config),
    )


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 0.95])
def test_expected_committed_matches_closed_form(alpha):
    for k in range(11):
        closed = (1 - alpha ** (k + 1)) / (1 - alpha)
        assert expected_committed([alpha], k) == pytest.approx(closed, rel=1e-12)
    assert expected_committed([1.0], 7) == 8.0


def test_expected_committed_per_position_and_padding():
    assert expected_committed([0.8, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert expected_committed([], 5) == 1.0
    assert expected_committed([0.9], 0) == 1.0


@pytest.mark.parametrize("pipelined", [False, True])
def test_zero_acceptance_never_speculates(pipelined):
    assert pick(0.0, pipelined=pipelined) == 0


@pytest.mark.parametrize(("pipelined", "max_k"), [(False, 8), (False, 16), (True, 8)])
def test_certain_acceptance_and_cheap_draft_uses_max_k(pipelined, max_k):
    assert pick(1.0, pipelined=pipelined, max_k=max_k) == max_k


@pytest.mark.parametrize("pipelined", [False, True])
def test_high_acceptance_and_cheap_draft_drafts_long(pipelined):
    assert pick(0.9, pipelined=pipelined) >= 5


@pytest.mark.parametrize("alpha", [0.5, 0.9, 1.0])
def test_draft_as_slow_as_target_is_not_worth_it(alpha):
    assert pick(alpha, EQUAL_DRAFT) == 0


def test_rising_rtt_lengthens_pipelined_blocks():
    ks = [pick(0.9, MID_DRAFT, rtt_s=rtt_s, pipelined=True) for rtt_s in RTTS_S]
    assert ks == sorted(ks) and ks[-1] > ks[0]  # [5, 8, 8]: drafting hides behind the hop


def test_rising_rtt_lengthens_best_block_but_can_switch_speculation_off():
    # Among k >= 1 the best block grows with RTT (the hop is amortised over more tokens), yet
    # unpipelined at 50 ms the 5x-longer round loses to target-only, which skips the hop.
    for pipelined in (False, True):
        best = []
        for rtt_s in RTTS_S:
            costs = dict(batch=4, verify=VERIFY, draft=MID_DRAFT, rtt_s=rtt_s, pipelined=pipelined)
            best.append(max(range(1, 17), key=lambda k: predicted_tokens_per_s([0.9], k, **costs)))
        assert best == sorted(best) and best[-1] > best[0]
    assert [pick(0.9, MID_DRAFT, rtt_s=rtt_s) for rtt_s in RTTS_S] == [7, 8, 0]


def test_pipelining_allows_longer_blocks_when_the_draft_is_not_the_bottleneck():
    for alpha in (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 1.0):
        for rtt_s in (*RTTS_S, 0.001):
            for batch in (1, 4, 16):
                unpipelined = pick(alpha, rtt_s=rtt_s, batch=batch)
                assert pick(alpha, rtt_s=rtt_s, batch=batch, pipelined=True) >= unpipelined


def test_pipelining_prefers_shorter_blocks_when_draft_bound():
    # 2.08 ms steps: beyond 5 of them the draft, not the 10.6 ms verify + hop, sets the round,
    # so each extra step costs its full time; unpipelined it is amortised over a longer round.
    assert pick(0.9, MID_DRAFT, pipelined=True) == 5 < pick(0.9, MID_DRAFT) == 7
    for k in range(9):  # pipelining never predicts a slower round
        costs = dict(batch=4, verify=VERIFY, draft=MID_DRAFT, rtt_s=0.0002)
        piped = predicted_tokens_per_s([0.9], k, **costs, pipelined=True)
        assert piped >= predicted_tokens_per_s([0.9], k, **costs, pipelined=False)


def test_max_tokens_left_caps_k():
    config = PolicyConfig()
    costs = dict(batch=4, verify=VERIFY, draft=CHEAP_DRAFT, rtt_s=0.0002, pipelined=False)
    assert choose_k([1.0], **costs, config=config, max_tokens_left=1) == 0
    assert choose_k([1.0], **costs, config=config, max_tokens_left=3) == 2


def test_min_gain_respected():
    # Docstring example: k = 2 predicts 1.75 tokens / 12 ms = 145.8 tok/s vs 100 target-only.
    costs = dict(batch=1, verify=VerifyCost(0.01, 0, 0), draft=DraftCost(0.001, 0), rtt_s=0)
    assert predicted_tokens_per_s([0.5], 2, **costs, pipelined=False) == pytest.approx(1750 / 12)
    for min_gain, expected in [(1.02, 2), (1.45, 2), (1.46, 0)]:
        config = PolicyConfig(min_gain=min_gain)
        assert choose_k([0.5], **costs, pipelined=False, config=config) == expected


def test_ties_go_to_smaller_k():
    # Free draft, flat verify, alpha = 0 beyond position 1: k = 1..8 all commit 2 tokens/round.
    costs = dict(batch=1, verify=VerifyCost(0.01, 0, 0), draft=DraftCost(0, 0), rtt_s=0)
    assert choose_k([1.0, 0.0], **costs, pipelined=False, config=PolicyConfig()) == 1


def _random_case(rng):
    """Acceptance lists of 0..10 values (some exactly 0 or 1, some ints) and varied costs."""
    acceptance = [
        rng.choice([rng.random(), rng.random(), 0.0, 1.0, 1]) for _ in range(rng.randrange(11))
    ]
    verify = VerifyCost(
        *(rng.choice([0.0, rng.uniform(0, 0.02), rng.uniform(0, 1e-4)]) for _ in range(3))
    )
    draft = DraftCost(
        *(rng.choice([0.0, rng.uniform(0, 0.01), rng.uniform(0, 1e-4)]) for _ in range(2))
    )
    costs = dict(
        batch=rng.choice([1, 2, 4, 16, 64, 512]),
        verify=verify,
        draft=draft,
        rtt_s=rng.choice([0.0, 0.0002, rng.uniform(0, 0.05)]),
        pipelined=rng.random() < 0.5,
        draft_ahead_min_hit=rng.choice([None, 0.0, 0.5, rng.random()]),
    )
    config = PolicyConfig(
        max_k=rng.randrange(33), min_gain=rng.choice([1.0, 1.02, rng.uniform(1, 2)])
    )
    return acceptance, costs, config


def test_choose_k_matches_brute_force_argmax_over_predicted_rates():
    rng = random.Random(20240611)
    speculated = 0
    for _ in range(2000):
        acceptance, costs, config = _random_case(rng)
        max_tokens_left = rng.choice([None, None, rng.randrange(1, 12)])
        cap = config.max_k if max_tokens_left is None else min(config.max_k, max_tokens_left - 1)
        rates = [predicted_tokens_per_s(acceptance, k, **costs) for k in range(cap + 1)]
        best = 0
        for k in range(1, cap + 1):  # first maximum: ties go to the smaller k
            best = k if best == 0 or rates[k] > rates[best] else best
        expected = best if best and rates[best] > config.min_gain * rates[0] else 0
        got = choose_k(acceptance, **costs, config=config, max_tokens_left=max_tokens_left)
        assert got == expected, (acceptance, costs, config, max_tokens_left)
        speculated += got > 0
    assert 200 < speculated < 1800  # the grid exercises both outcomes


def test_predicted_rate_is_exactly_the_cost_model_formula():
    # predicted_tokens_per_s / choose_k evaluate round times from per-batch terms; they must be
    # bit-identical to composing the public cost methods per k.
    rng = random.Random(7)
    for _ in range(500):
        acceptance, costs, _ = _random_case(rng)
        batch, verify, draft = costs["batch"], costs["verify"], costs["draft"]
        rtt_s, pipelined = costs["rtt_s"], costs["pipelined"]
        min_hit = costs["draft_ahead_min_hit"]
        for k in range(12):
            committed = 1.0
            reach = 1.0
            for j in range(k):
                reach *= float(acceptance[min(j, len(acceptance) - 1)]) if acceptance else 0.0
                committed += reach
            assert expected_committed(acceptance, k) == committed
            # the fraction of the draft hidden behind target work
            hit = draft_ahead_hit(acceptance, k)
            if pipelined:
                hidden = 1.0
            else:
                hidden = hit if min_hit is not None and k > 0 and hit >= min_hit else 0.0
            if k == 0:
                round_s = verify.seconds(batch, 1)
            else:
                exposed_draft_s = (1.0 - hidden) * (k * draft.seconds(batch))
                if min_hit is None:
                    exposed_s = verify.seconds(batch, k + 1) + rtt_s + exposed_draft_s
                else:  # draft-ahead folds the verdict: the draft overlaps the hop back
                    exposed_s = verify.seconds(batch, k + 1) + max(exposed_draft_s, rtt_s)
                round_s = max(exposed_s, k * draft.seconds(batch))
            expected = batch * committed / round_s if round_s > 0 else math.inf
            assert predicted_tokens_per_s(acceptance, k, **costs) == expected


def test_free_rounds_predict_infinite_rate_and_do_not_speculate():
    costs = dict(batch=4, verify=VerifyCost(0, 0, 0), draft=DraftCost(0, 0), rtt_s=0)
    assert predicted_tokens_per_s([0.9], 3, **costs, pipelined=False) == math.inf
    assert choose_k([0.9], **costs, pipelined=False, config=PolicyConfig()) == 0


def test_fit_verify_cost_recovers_coefficients_and_falls_back():
    prior = VerifyCost(1.0, 1.0, 1.0)
    samples = [(b, t, VERIFY.seconds(b, t)) for b in (1, 2, 4, 8) for t in (1, 3, 5)]
    fitted = fit_verify_cost(samples, prior)
    assert fitted.fixed_s == pytest.approx(VERIFY.fixed_s, abs=1e-9)
    assert fitted.per_request_s == pytest.approx(VERIFY.per_request_s, abs=1e-9)
    assert fitted.per_token_s == pytest.approx(VERIFY.per_token_s, abs=1e-9)
    assert fit_verify_cost([], prior) == prior
    # One (batch, tokens) point: the prior (0.014 s there) is scaled to the observed mean.
    scaled = fit_verify_cost([(4, 3, 0.0130), (4, 3, 0.0134)], VerifyCost(0.01, 0.001, 0.0))
    assert scaled.seconds(4, 3) == pytest.approx(0.0132, abs=1e-12)
    assert scaled.fixed_s / scaled.per_request_s == pytest.approx(10.0)
    # Only t = 3: fixed_s is identified, per_request_s + 3 per_token_s split as in the prior.
    one_t = fit_verify_cost([(b, 3, VERIFY.seconds(b, 3)) for b in (1, 2, 4)], prior)
    assert one_t.fixed_s == pytest.approx(VERIFY.fixed_s, abs=1e-12)
    assert one_t.per_request_s == pytest.approx(one_t.per_token_s)
    assert one_t.seconds(6, 3) == pytest.approx(VERIFY.seconds(6, 3), abs=1e-12)


def test_fit_verify_cost_clamps_negative_coefficients():
    samples = [(b, t, max(0.0, 0.01 - 0.001 * b + 0.0001 * b * t)) for b in (1, 4) for t in (1, 5)]
    fitted = fit_verify_cost(samples, VerifyCost(0.01, 0.001, 0.0))
    assert min(fitted.fixed_s, fitted.per_request_s, fitted.per_token_s) >= 0.0


def test_fit_draft_cost_recovers_coefficients_and_falls_back():
    prior = DraftCost(1.0, 1.0)
    fitted = fit_draft_cost([(b, MID_DRAFT.seconds(b)) for b in (1, 2, 8)], prior)
    assert fitted.fixed_s == pytest.approx(MID_DRAFT.fixed_s, abs=1e-9)
    assert fitted.per_request_s == pytest.approx(MID_DRAFT.per_request_s, abs=1e-9)
    assert fit_draft_cost([], prior) == prior
    scaled = fit_draft_cost([(3, 0.008)], DraftCost(0.001, 0.001))
    assert (scaled.fixed_s, scaled.per_request_s) == pytest.approx((0.002, 0.002))


def test_estimator_prior_worked_example_and_limits():
    fresh = AcceptanceEstimator()
    assert fresh.acceptance(3) == [0.5, 0.5, 0.5]
    fresh.update(4, 2)  # docstring example
    assert fresh.acceptance(5) == pytest.approx([2.2 / 3, 2.2 / 3, 0.4, 0.6, 0.6])
    accepting, rejecting = AcceptanceEstimator(), AcceptanceEstimator()
    for _ in range(100):
        accepting.update(4, 4)
        rejecting.update(4, 0)
    assert min(accepting.acceptance(8)) > 0.95
    assert rejecting.acceptance(1)[0] < 0.1


def test_estimator_acceptance_is_a_fresh_list_that_follows_updates():
    estimator = AcceptanceEstimator()
    first = estimator.acceptance(4)
    first[0] = 99.0  # callers may mutate what they get
    assert estimator.acceptance(4) == [0.5] * 4
    assert estimator.acceptance(2) == [0.5] * 2
    estimator.update(4, 2)
    assert estimator.acceptance(5) == pytest.approx([2.2 / 3, 2.2 / 3, 0.4, 0.6, 0.6])
    assert estimator.acceptance(2) == pytest.approx([2.2 / 3, 2.2 / 3])
    assert estimator.acceptance(5) == pytest.approx([2.2 / 3, 2.2 / 3, 0.4, 0.6, 0.6])
    estimator.update(4, 4)
    assert estimator.acceptance(5)[0] > 2.2 / 3
    with pytest.raises(ValueError, match="max_k must be"):
        estimator.acceptance(True)


def test_estimator_decay_makes_recent_data_dominate():
    decayed, remembering = AcceptanceEstimator(decay=0.9), AcceptanceEstimator(decay=1.0)
    for estimator in (decayed, remembering):
        for _ in range(50):
            estimator.update(4, 4)
        for _ in range(20):
            estimator.update(4, 0)
    assert decayed.acceptance(1)[0] < 0.2 < 0.5 < remembering.acceptance(1)[0]


def test_should_probe():
    assert not should_probe(15, PolicyConfig())
    assert should_probe(16, PolicyConfig())
    assert should_probe(1, PolicyConfig(probe_every_rounds=1))
    # Backoff: each probe in a row that found no gain doubles the wait, up to 2^max times.
    assert not should_probe(31, PolicyConfig(), failed_probes=1)
    assert should_probe(32, PolicyConfig(), failed_probes=1)
    assert not should_probe(255, PolicyConfig(max_probe_backoff=4), failed_probes=9)
    assert should_probe(256, PolicyConfig(max_probe_backoff=4), failed_probes=9)


def _costs(**overrides):
    costs = dict(batch=4, verify=VERIFY, draft=CHEAP_DRAFT, rtt_s=0.0, pipelined=False)
    return {**costs, **overrides}


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: VerifyCost(-1.0, 0.0, 0.0), "fixed_s"),
        (lambda: VerifyCost(0.0, float("nan"), 0.0), "per_request_s"),
        (lambda: VerifyCost(0.0, 0.0, -1e-9), "per_token_s"),
        (lambda: DraftCost(0.0, -1.0), "per_request_s"),
        (lambda: VERIFY.seconds(0, 1), "batch"),
        (lambda: VERIFY.seconds(1, 0), "tokens_per_request"),
        (lambda: CHEAP_DRAFT.seconds(True), "batch"),
        (lambda: PolicyConfig(max_k=33), "max_k"),
        (lambda: PolicyConfig(max_k=-1), "max_k"),
        (lambda: PolicyConfig(probe_k=0), "probe_k"),
        (lambda: PolicyConfig(probe_every_rounds=0), "probe_every_rounds"),
        (lambda: PolicyConfig(min_gain=0.99), "min_gain"),
        (lambda: expected_committed([0.5, 1.5], 2), "acceptance[1]"),
        (lambda: expected_committed([0.5], -1), "k"),
        (lambda: predicted_tokens_per_s([0.5], 1, **_costs(rtt_s=-0.001)), "rtt_s"),
        (lambda: predicted_tokens_per_s([0.5], 1, **_costs(batch=0)), "batch"),
        (
            lambda: choose_k([0.5], **_costs(), config=PolicyConfig(), max_tokens_left=0),
            "max_tokens_left",
        ),
        (lambda: choose_k([0.5], **_costs(batch=0), config=PolicyConfig()), "batch"),
        (lambda: choose_k([0.5, float("nan")], **_costs(), config=PolicyConfig()), "acceptance[1]"),
        (lambda: choose_k([0.5], **_costs(rtt_s=math.inf), config=PolicyConfig()), "rtt_s"),
        (
            lambda: fit_verify_cost([(1, 1, 0.01), (2, 0, 0.01)], VERIFY),
            "samples[1] tokens_per_request",
        ),
        (lambda: fit_draft_cost([(1, -0.01)], CHEAP_DRAFT), "samples[0] seconds"),
        (lambda: should_probe(-1, PolicyConfig()), "rounds_since_speculation"),
        (lambda: AcceptanceEstimator(prior_alpha=1.5), "prior_alpha"),
        (lambda: AcceptanceEstimator(prior_weight=0.0), "prior_weight"),
        (lambda: AcceptanceEstimator(decay=0.0), "decay"),
        (lambda: AcceptanceEstimator().update(2, 3), "num_accepted"),
        (lambda: AcceptanceEstimator().update(-1, 0), "num_draft_tokens"),
        (lambda: AcceptanceEstimator().acceptance(-1), "max_k"),
    ],
)
def test_validation_errors_name_the_parameter(make, name):
    with pytest.raises(ValueError, match=re.escape(name) + " must be"):
        make()


def test_measured_tables_interpolate_and_extrapolate():
    # Measured here (ms): one row is a fast matrix-vector product; 2..5 rows cost about the same.
    verify = VerifyCost(0.0, 0.0, 0.0, table=((1, 0.075), (2, 0.126), (3, 0.18), (5, 0.177)))
    assert verify.seconds(1, 1) == 0.075
    assert verify.seconds(1, 4) == pytest.approx((0.18 + 0.177) / 2)
    assert verify.seconds(2, 5) == pytest.approx(0.177 + (0.177 - 0.18) / 2 * 5)  # past the end
    draft = DraftCost(0.0, 0.0, table=((1, 0.05), (8, 0.12)))
    assert draft.seconds(4) == pytest.approx(0.05 + 0.07 * 3 / 7)
    with pytest.raises(ValueError, match="increasing"):
        VerifyCost(0.0, 0.0, 0.0, table=((2, 0.1), (1, 0.2)))


def test_a_table_where_short_blocks_cost_as_much_as_long_ones_prefers_long_blocks():
    verify = VerifyCost(0.0, 0.0, 0.0, table=((1, 0.075), (2, 0.17), (9, 0.18)))
    draft = DraftCost(0.0, 0.0, table=((1, 0.001),))
    k = choose_k(
        [0.95] * 8,
        batch=1,
        verify=verify,
        draft=draft,
        rtt_s=0.0,
        pipelined=False,
        config=PolicyConfig(max_k=8),
    )
    assert k == 8


def test_tabulate_averages_repeats_and_removes_dips():
    # 3 tokens measured slower than 4 (noise: 4 could be run as 3 padded); repeats averaged.
    samples = [(1, 0.046), (3, 0.062), (4, 0.045), (8, 0.060), (8, 0.070), (16, 0.080)]
    assert tabulate(samples) == ((1.0, 0.045), (3.0, 0.045), (4.0, 0.045), (8.0, 0.065),
                                 (16.0, 0.080))  # fmt: skip
    increasing = [(1, 0.01), (2, 0.02), (4, 0.03)]
    assert tabulate(increasing) == ((1.0, 0.01), (2.0, 0.02), (4.0, 0.03))


def test_draft_ahead_only_for_blocks_likely_kept_whole():
    # Kept: all k drafts accepted and the bonus token equal to the draft's next guess.
    assert draft_ahead_hit([0.8, 0.5], 2) == pytest.approx(0.8 * 0.5 * 0.5)
    assert draft_ahead_hit([0.9], 3) == pytest.approx(0.9**4)  # later positions reuse the last
    assert should_draft_ahead([0.95], 4, 0.5)  # a close draft: 0.77
    assert not should_draft_ahead([0.45, 0.6, 0.8], 3, 0.5)  # the shipped pair here: 0.17
    assert should_draft_ahead([0.0], 4, 0.0)  # min_hit 0: always
    with pytest.raises(ValueError, match="min_hit"):
        should_draft_ahead([0.5], 1, 1.5)


# ---- one block length for a batch -----------------------------------------------------------

FLAT = dict(verify=VerifyCost(0.010, 0.0, 0.0), draft=DraftCost(0.001, 0.0), rtt_s=0.0)


def test_batch_k_example_every_request_drafts_the_longest_paying_block():
    # docstring example: K = 8 gives (6.13 + 1.11) / 18 ms = 402 tok/s, K = 1 only 273
    ks = dict(pipelined=False, **FLAT)
    assert choose_batch_k([[0.9], [0.1]], [8, 8], config=PolicyConfig(), **ks) == 8
    assert choose_batch_k([[0.9], [0.1]], [8, 8], config=PolicyConfig(max_k=4), **ks) == 4
    # [0.1] alone stops early: its own best block is short
    assert choose_k([0.1], batch=1, config=PolicyConfig(), pipelined=False, **FLAT) <= 1
    # a request that cannot draft (cap 0) neither blocks nor lengthens the others' block
    assert choose_batch_k([[0.0], [0.9]], [0, 3], config=PolicyConfig(), **ks) == 3
    assert choose_batch_k([[0.9], [0.9]], [0, 0], config=PolicyConfig(), **ks) == 0


def test_batch_k_matches_choose_k_for_identical_requests():
    """b identical requests: the batch's K is choose_k's k at batch b (pipelined, or without
    draft-ahead; a lone request with draft-ahead too, its hit being the batch's)."""
    rng = random.Random(99)
    for _ in range(1500):
        acceptance, costs, config = _random_case(rng)
        batch = costs.pop("batch")
        if costs["pipelined"] or costs["draft_ahead_min_hit"] is None:
            size = batch if batch <= 16 else 16
        else:
            size = 1
        cap = rng.randrange(1, 12)
        got = choose_batch_k([acceptance] * size, [cap] * size, config=config, **costs)
        expected = choose_k(acceptance, batch=size, config=config, max_tokens_left=cap + 1, **costs)
        assert got == expected, (acceptance, costs, config, size, cap)


def test_batch_k_with_draft_ahead_hides_only_what_every_request_keeps():
    """Verify 10 ms flat, draft step 5.5 ms, α = 0.5, K = 1: a request's drafts made ahead are
    kept with probability 0.5 * 0.5 = 0.25. Alone, 75% of the draft shows:
    1.5 / (10 + 4.1 ms) = 106 tok/s beats 1.02 x 100. Two requests keep theirs both only
    6.25% of the time: 3 / (10 + 5.2 ms) = 198 tok/s loses to 1.02 x 200. Without draft-ahead
    nothing hides: 1.5 / 15.5 ms = 97."""
    costs = dict(verify=VerifyCost(0.010, 0.0, 0.0), draft=DraftCost(0.0055, 0.0), rtt_s=0.0)
    ahead = dict(pipelined=False, config=PolicyConfig(), draft_ahead_min_hit=0.0, **costs)
    assert choose_batch_k([[0.5]], [8], **ahead) == 1
    assert choose_batch_k([[0.5], [0.5]], [8, 8], **ahead) == 0
    assert choose_batch_k([[0.5]], [8], pipelined=False, config=PolicyConfig(), **costs) == 0
    # drafts are made ahead only when each request's are likely kept (min hit 0.3 > 0.25)
    assert choose_batch_k([[0.5]], [8], **(ahead | {"draft_ahead_min_hit": 0.3})) == 0


@pytest.mark.parametrize(
    ("acceptances", "caps", "message"),
    [
        ([[0.5]], [1, 2], "one cap per acceptance"),
        ([], [], "one cap per acceptance"),
        ([[0.5]], [-1], r"caps\[0\]"),
        ([[1.5]], [2], r"acceptance\[0\]"),
    ],
)
def test_batch_k_rejects_bad_input_by_name(acceptances, caps, message):
    with pytest.raises(ValueError, match=message):
        choose_batch_k(acceptances, caps, pipelined=False, config=PolicyConfig(), **FLAT)


def test_a_speculating_batch_goes_on_until_it_clearly_loses():
    """Hysteresis: predicted 1.5 / (10 + 5.5 ms) = 96.8 tok/s against 100 target-only
    (α = 0.5, K = 1, no draft-ahead) does not start speculation (needs > 102), but a batch
    speculating already goes on (above 95); at α = 0.3 (1.3 / 15.5 ms = 83.9) it stops."""
    costs = dict(verify=VerifyCost(0.010, 0.0, 0.0), draft=DraftCost(0.0055, 0.0), rtt_s=0.0)
    kwargs = dict(pipelined=False, config=PolicyConfig(max_k=1), **costs)
    assert choose_batch_k([[0.5]], [8], **kwargs) == 0
    assert choose_batch_k([[0.5]], [8], speculating=True, **kwargs) == 1
    assert choose_batch_k([[0.3]], [8], speculating=True, **kwargs) == 0
    with pytest.raises(ValueError, match="stop_gain"):
        PolicyConfig(min_gain=1.02, stop_gain=1.1)
