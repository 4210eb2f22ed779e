"""The coordinator's block-length rules on worked numbers: no Ray, no clock, no coordinator.

Costs are chosen so that the rates can be checked by hand: verification 10 ms flat (or 10 ms
plus 1 ms per verified token and request), a draft step 1 ms (or free), no network time.
"""

import pytest

from specray.engine_core.block_length import (
    SCOUT_REQUESTS,
    Measurements,
    RequestProbe,
    best_k,
    choose_ks,
    could_pay,
    draft_prefills_wanted,
    group_would_speculate,
    overlap,
    policy_ks,
    split_pays,
)
from specray.engine_core.coordinator import CoordinatorConfig
from specray.engine_core.policy import DraftCost, PolicyConfig, VerifyCost

FLAT_10MS = VerifyCost(0.010, 0.0, 0.0)
DRAFT_1MS = DraftCost(0.001, 0.0)


def _config(**overrides) -> CoordinatorConfig:
    """One micro-batch, k up to 4, no draft-ahead (so an unpipelined round is verify + draft),
    a probe after 4 rounds without drafts."""
    values = {
        "num_micro_batches": 1,
        "num_speculative_tokens": 4,
        "draft_ahead": False,
        "policy": PolicyConfig(probe_every_rounds=4),
    }
    return CoordinatorConfig(**(values | overrides))


def _measured(group_alpha=0.05, *, verify=FLAT_10MS, draft=DRAFT_1MS, pipelined=False):
    return Measurements(
        verify=verify, draft=draft, rtt_s=0.0, group_acceptance=(group_alpha,) * 4,
        pipelined=pipelined,
    )  # fmt: skip


def test_overlap_counts_the_pipeline_or_the_drafts_made_ahead():
    ahead = _config(draft_ahead=True, draft_ahead_min_hit=0.3)
    assert overlap(ahead, pipelined=True) == {"pipelined": True, "draft_ahead_min_hit": 0.3}
    assert overlap(_config(), pipelined=False) == {"pipelined": False, "draft_ahead_min_hit": None}


def test_best_k_and_the_groups_verdict():
    """α = 0.5, batch 1: unpipelined k = 1 gives 1.5 / 11 ms = 136 tok/s, k = 2 1.75 / 12 ms =
    146, k = 3 1.875 / 13 ms = 144 against 100 target-only: k = 2. Pipelined (optimistic, two
    micro-batches) a round costs the 10 ms verification whatever k: the longest, 4. At α = 0.05
    k = 1 gives 1.05 / 11 ms = 95 tok/s: below target-only, the group would not speculate."""
    config = _config(num_micro_batches=2)
    assert best_k([0.5], 1, _measured(), config) == 2
    assert best_k([0.5], 1, _measured(), config, optimistic=True) == 4
    assert best_k([0.5], 1, _measured(pipelined=True), config) == 4
    assert group_would_speculate(1, _measured(0.5), config)
    assert not group_would_speculate(1, _measured(0.05), config)


def test_could_pay_asks_whether_full_acceptance_would():
    """Batch 8 with every draft accepted: k = 4 commits 5 tokens a request per 14 ms (2857
    tok/s) against 8 per 10 ms: it could pay. If verification costs 10 ms per token and
    request, k + 1 tokens cost as much as k + 1 target-only rounds: it never can."""
    config = _config()
    assert could_pay(8, _measured(), config, has_drafts=True)
    per_token = VerifyCost(0.0, 0.0, 0.010)
    assert not could_pay(8, _measured(verify=per_token), config, has_drafts=True)
    assert not could_pay(8, _measured(), config, has_drafts=False)
    assert not could_pay(8, _measured(), _config(num_speculative_tokens=0), has_drafts=True)
    assert could_pay(8, _measured(verify=per_token), _config(adaptive_k=False), has_drafts=True)


def test_split_pays_against_one_target_only_batch():
    """Two micro-batches, free drafts, group α = 0.9. Verification 10 ms + 1 ms per token and
    request, k at most 1: halves of 4 verifying 2 tokens commit 4 * 1.9 per 18 ms = 422 tok/s,
    one batch of 8 target-only 8 per 18 ms = 444: no split. Verification 10 ms flat, k up to
    4: halves commit 4 * 4.095 per 10 ms = 1638 tok/s against 800: split."""
    free = DraftCost(0.0, 0.0)
    linear = _measured(0.9, verify=VerifyCost(0.010, 0.0, 0.001), draft=free)
    one = _config(num_micro_batches=2, num_speculative_tokens=1)
    assert not split_pays(8, linear, one, has_drafts=True)
    flat = _measured(0.9, draft=free)
    four = _config(num_micro_batches=2)
    assert split_pays(8, flat, four, has_drafts=True)
    assert not split_pays(1, flat, four, has_drafts=True)  # nothing to split
    assert not split_pays(8, flat, _config(), has_drafts=True)  # one micro-batch
    assert not split_pays(8, flat, four, has_drafts=False)
    fixed = _config(num_micro_batches=2, adaptive_k=False)
    assert split_pays(8, flat, fixed, has_drafts=True)
    assert not split_pays(8, flat, fixed, has_drafts=False)


def test_draft_prefills_wanted_hands_over_untried_requests_a_few_at_a_time():
    """Batch 16 at α = 0.05: k = 1 gives 16 * 1.05 per 11 ms = 1527 tok/s against 1600, so the
    group would not speculate, though full acceptance would pay. Fresh requests are handed to
    the draft workers so that SCOUT_REQUESTS of them wait for their first try, counting the
    untried ones the draft workers hold already: each gets its chance, a few at a time."""
    config, low = _config(), _measured(0.05)
    assert SCOUT_REQUESTS == 2
    assert draft_prefills_wanted(16, 0, 16, low, config, has_drafts=True) == 2
    assert draft_prefills_wanted(15, 1, 16, low, config, has_drafts=True) == 1
    assert draft_prefills_wanted(3, 2, 16, low, config, has_drafts=True) == 0
    assert draft_prefills_wanted(1, 0, 1, low, config, has_drafts=True) == 1  # 2 scouts, 1 fresh
    # The group would speculate (α = 0.9), adaptive k is off, or nothing could pay:
    assert draft_prefills_wanted(15, 1, 16, _measured(0.9), config, has_drafts=True) == 15
    assert draft_prefills_wanted(15, 2, 16, low, _config(adaptive_k=False), has_drafts=True) == 15
    per_token = _measured(0.05, verify=VerifyCost(0.0, 0.0, 0.010))
    assert draft_prefills_wanted(15, 0, 16, per_token, config, has_drafts=True) == 0


TRIED = RequestProbe(tried=True)


def _policy(caps, acceptances, probes, steps, measured, config, speculating=False):
    return policy_ks(
        caps, acceptances, probes, steps, speculating, measured, config, has_drafts=True
    )


def test_one_block_length_for_the_batch():
    """Two requests, caps 4, α 0.9 and 0.1: K = 4 commits 4.10 + 1.11 tokens per 14 ms = 372
    tok/s against 200 target-only (K = 1: 3.0 / 11 ms = 273): both draft 4; a cap cuts its
    own request's block only. Drafting under the policy's K resets a request's probing."""
    config = _config()
    acceptances = [[0.9] * 4, [0.1] * 4]
    probes = [RequestProbe(tried=True, rounds_off=3, failed_probes=2), RequestProbe()]
    ks, after, speculating = choose_ks(
        [4, 4], acceptances, [False, False], probes, [0, 0], False, _measured(), config,
        has_drafts=True,
    )  # fmt: skip
    assert (ks, after, speculating) == ([4, 4], [TRIED, TRIED], True)
    ks, _, _ = _policy([4, 2], acceptances, probes, [0, 0], _measured(), config)
    assert ks == [4, 2]


def test_a_new_request_probes_at_once_then_after_its_own_rounds_off():
    """α 0.05 for everyone: K = 1 gives (3 * 1.05 + 1) / 11 ms = 377 tok/s against 400, so no
    drafts. Requests that never drafted probe at their first chance; while the group's
    acceptance says no, at most SCOUT_REQUESTS a round, the untried first, then those that
    drafted longest ago (steps 3 and 5). A tried request waits probe_every_rounds (4) of its
    own rounds; once the group says yes, everyone due probes."""
    config, low = _config(), _measured(0.05)
    caps, acceptances, steps = [4, 4, 0, 4], [[0.05] * 4] * 4, [9, 3, 0, 5]
    new = [RequestProbe()] * 4
    ks, after, speculating = _policy(caps, acceptances, new, steps, low, config)
    assert (ks, speculating) == ([0, 2, 0, 2], False)  # untried, then longest ago
    assert after[1] == after[3] == RequestProbe(tried=True, failed_probes=1)
    assert after[0] == RequestProbe(rounds_off=1)  # its turn next round
    waiting = [RequestProbe(tried=True, rounds_off=1)] * 4
    ks, after, _ = _policy(caps, acceptances, waiting, steps, low, config)
    assert ks == [0, 0, 0, 0] and after[0] == RequestProbe(tried=True, rounds_off=2)
    assert after[2] == waiting[2]  # cap 0: its rounds do not count
    due = [RequestProbe(tried=True, rounds_off=3)] * 4
    ks, after, _ = _policy(caps, acceptances, due, steps, low, config)
    assert ks == [0, 2, 0, 2]  # drafted longest ago: steps 3 and 5
    assert after[1] == RequestProbe(tried=True, failed_probes=1)
    assert after[0] == RequestProbe(tried=True, rounds_off=4)  # due, waits for a slot
    ks, _, _ = _policy(caps, acceptances, due, steps, _measured(0.9), config)
    assert ks == [2, 2, 0, 2]


def test_each_failed_probe_doubles_a_requests_wait():
    """After one probe that found no gain the request's next is due after 8 of its rounds,
    not 4; another request's failures do not count."""
    config, low = _config(), _measured(0.05)
    caps, acceptances, steps = [4, 4], [[0.05] * 4] * 2, [1, 2]
    probes = [RequestProbe(tried=True, rounds_off=6, failed_probes=1)] * 2
    ks, after, _ = _policy(caps, acceptances, probes, steps, low, config)
    assert (ks, after) == ([0, 0], [RequestProbe(tried=True, rounds_off=7, failed_probes=1)] * 2)
    ks, after, _ = _policy(caps, acceptances, after, steps, low, config)
    assert ks == [2, 2] and after == [RequestProbe(tried=True, failed_probes=2)] * 2
    mixed = [RequestProbe(tried=True, rounds_off=3), RequestProbe(tried=True, failed_probes=3)]
    ks, _, _ = _policy(caps, acceptances, mixed, steps, low, config)
    assert ks == [2, 0]


@pytest.mark.parametrize("adaptive", [True, False])
def test_fixed_requests_draft_their_cap_and_adaptive_off_drafts_every_cap(adaptive):
    """A fixed-k request (speculation "on", or seeded under reproducible_seeds) drafts its cap
    whatever the policy says; with adaptive k off every request does, and the probes are left
    as they were."""
    config, low = _config(adaptive_k=adaptive), _measured(0.05)
    caps, acceptances = [3, 4, 0], [[0.05] * 4] * 3
    probes = [RequestProbe(tried=True, rounds_off=1)] * 3
    ks, after, _ = choose_ks(
        caps, acceptances, [True, False, True], probes, [0, 0, 0], False, low, config,
        has_drafts=True,
    )  # fmt: skip
    assert ks == ([3, 0, 0] if adaptive else [3, 4, 0])
    waited = RequestProbe(tried=True, rounds_off=2)
    assert after == ([waited, waited, probes[2]] if adaptive else probes)
