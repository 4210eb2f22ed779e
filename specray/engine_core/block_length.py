"""The block length of each micro-batch round, and the group decisions that hang on it
(split into micro-batches or not, hand requests to the draft workers or not), as pure functions
of what the coordinator measured.

Per micro-batch and round one K comes from :func:`specray.engine_core.policy.choose_batch_k` on its
requests' measured per-position acceptance and the group's measured costs (verify time as a
function of batch and tokens, draft step time, network round trip): a round costs what its
longest block costs, so every request drafts K (fewer only near its max_tokens). K = 0 runs the
batch target-only, and it is probed again after ``probe_every_rounds`` rounds; the micro-batch
carries what that needs from round to round in a :class:`ProbeState`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from specray.engine_core.coordinator_config import CoordinatorConfig
from specray.engine_core.policy import (
    DraftCost,
    VerifyCost,
    choose_batch_k,
    choose_k,
    predicted_tokens_per_s,
    should_probe,
)

SCOUT_REQUESTS = 2  # requests that re-measure acceptance while the group's says "do not draft"


@dataclass(frozen=True)
class Measurements:
    """What the rules read, as the coordinator measured it just now."""

    verify: VerifyCost  # the target's verification time, fitted online
    draft: DraftCost  # one draft step, fitted online
    rtt_s: float  # coordinator <-> target round trip
    group_acceptance: tuple[float, ...]  # the group's running α_1..α_num_speculative_tokens
    pipelined: bool  # more than one micro-batch holds requests now


@dataclass(frozen=True)
class ProbeState:
    """What one micro-batch's block-length choice remembers from its earlier rounds."""

    speculating: bool = False  # the policy's last choice: K > 0 (probes do not count)
    rounds_off: int = 0  # rounds in a row without drafts
    failed_probes: int = 0  # probes in a row that found no gain


def overlap(config: CoordinatorConfig, *, pipelined: bool) -> dict:
    """How much of a block's draft the policy may count as hidden behind target work: all
    of it while another micro-batch is there to verify meanwhile (``pipelined``); else, with
    draft-ahead, as much as the drafts made ahead are expected to be kept (and the rest
    overlaps the network hop: the draft worker folds the verdict in as soon as it arrives);
    else none."""
    ahead = config.draft_ahead_min_hit if config.draft_ahead else None
    return {"pipelined": pipelined, "draft_ahead_min_hit": ahead}


def best_k(
    acceptance: Sequence[float],
    batch_size: int,
    measured: Measurements,
    config: CoordinatorConfig,
    *,
    optimistic: bool = False,
) -> int:
    """The policy's k for a request with this acceptance in a batch of this size.
    ``optimistic``: as if the group were split whenever it can be."""
    pipelined = config.num_micro_batches > 1 if optimistic else measured.pipelined
    return choose_k(
        acceptance,
        batch=max(batch_size, 1),
        verify=measured.verify,
        draft=measured.draft,
        rtt_s=measured.rtt_s,
        config=config.policy,
        **overlap(config, pipelined=pipelined),
    )


def group_would_speculate(
    batch_size: int, measured: Measurements, config: CoordinatorConfig
) -> bool:
    """Would the policy speculate at this batch size with the group's acceptance?"""
    return best_k(measured.group_acceptance, batch_size, measured, config) > 0


def could_pay(
    batch_size: int, measured: Measurements, config: CoordinatorConfig, *, has_drafts: bool
) -> bool:
    """Would speculation pay at this batch size if every draft were accepted? If not, no
    acceptance measurement can change the answer: no probes, no micro-batch split."""
    if not has_drafts or config.num_speculative_tokens == 0:
        return False
    return not config.adaptive_k or best_k([1.0], batch_size, measured, config, optimistic=True) > 0


def split_pays(
    total: int, measured: Measurements, config: CoordinatorConfig, *, has_drafts: bool
) -> bool:
    """Split ``total`` running requests into micro-batches only when speculating on the parts
    beats verifying everyone in one batch without drafts. With one target and pipelining,
    the group's rate is one micro-batch's rate (the target alternates between them).

    Example (2 micro-batches, verify 10 ms + 1 ms per token and request, free draft and
    network, α = 0.9, max k 1): 8 requests split into two batches of 4 verifying 2 tokens
    each commit 4 * 1.9 tokens per 18 ms, 422 tok/s; one batch of 8 target-only commits 8
    per 18 ms, 444 tok/s: no split."""
    if config.num_micro_batches == 1 or total < 2:
        return False
    if not config.adaptive_k:
        return has_drafts
    if not could_pay(total, measured, config, has_drafts=has_drafts):
        return False
    size = math.ceil(total / config.num_micro_batches)
    split = max(
        predicted_tokens_per_s(
            measured.group_acceptance,
            k,
            batch=size,
            verify=measured.verify,
            draft=measured.draft,
            rtt_s=measured.rtt_s,
            pipelined=True,
        )
        for k in range(1, config.num_speculative_tokens + 1)
    )
    single = total / measured.verify.seconds(max(total, 1), 1)
    return split > config.policy.min_gain * single


def draft_prefills_wanted(
    num_fresh: int,
    batch_size: int,
    measured: Measurements,
    config: CoordinatorConfig,
    *,
    has_drafts: bool,
) -> int:
    """How many of a micro-batch's ``num_fresh`` requests the draft workers have not seen to
    hand them now (the first ones): all while the batch would speculate; otherwise only enough
    for SCOUT_REQUESTS scouts, and none if speculation cannot pay at this batch size. A draft
    prefill computes beside the target (on a shared host it slowed the target's rounds ~10% at
    concurrency 16 here) and is wasted on a request that never drafts; the others are handed
    over when speculation comes back. E.g. 16 requests, 15 of them fresh, the group's
    acceptance saying no: 1 (one scout is held already)."""
    if not config.adaptive_k or group_would_speculate(batch_size, measured, config):
        return num_fresh
    if not could_pay(batch_size, measured, config, has_drafts=has_drafts):
        return 0
    held = batch_size - num_fresh
    return min(max(SCOUT_REQUESTS - held, 0), num_fresh)


def choose_ks(
    caps: Sequence[int],
    acceptances: Sequence[Sequence[float]],
    fixed: Sequence[bool],
    last_drafted_steps: Sequence[int],
    probe: ProbeState,
    measured: Measurements,
    config: CoordinatorConfig,
    *,
    has_drafts: bool,
) -> tuple[list[int], ProbeState]:
    """k per request of one micro-batch round, and the micro-batch's probe state after it.

    Request i may draft at most ``caps[i]`` tokens (0: not this round); ``acceptances[i]`` is
    its α_1..α_num_speculative_tokens, ``last_drafted_steps[i]`` its step when it last drafted
    (0: never). The k is the policy's (:func:`policy_ks`), but a ``fixed`` request drafts its
    cap every round after its first (that one prefills it on the target: cap 0, whatever
    happens)."""
    ks, probe = policy_ks(
        caps, acceptances, last_drafted_steps, probe, measured, config, has_drafts=has_drafts
    )
    return [cap if fixed_k else k for fixed_k, cap, k in zip(fixed, caps, ks, strict=True)], probe


def policy_ks(
    caps: Sequence[int],
    acceptances: Sequence[Sequence[float]],
    last_drafted_steps: Sequence[int],
    probe: ProbeState,
    measured: Measurements,
    config: CoordinatorConfig,
    *,
    has_drafts: bool,
) -> tuple[list[int], ProbeState]:
    """k per request: one block length for the batch (a round costs what its longest block
    costs), cut by each request's cap. When the batch has not speculated for
    ``probe_every_rounds`` rounds it probes, so that acceptance is re-measured and
    speculation comes back when it pays again.

    While the group's acceptance says "do not draft", a probe re-measures it on
    SCOUT_REQUESTS scouts, the requests that drafted longest ago, instead of the whole batch
    (at batch 16, two more verified tokens for everyone cost 2.6x a step here); everyone
    probes once it says yes. E.g. caps [4, 4, 0, 4], last drafted at steps [9, 3, 0, 5]: the
    probe drafts probe_k = 2 for requests 1 and 3: [0, 2, 0, 2]."""
    if not config.adaptive_k:
        return list(caps), probe
    ks = [0] * len(caps)
    if any(caps):
        block = choose_batch_k(
            acceptances,
            caps,
            verify=measured.verify,
            draft=measured.draft,
            rtt_s=measured.rtt_s,
            config=config.policy,
            speculating=probe.speculating,
            **overlap(config, pipelined=measured.pipelined),
        )
        ks = [min(block, cap) for cap in caps]
    if any(ks):
        return ks, ProbeState(speculating=True)
    rounds_off, failed = probe.rounds_off + 1, probe.failed_probes
    probe_due = should_probe(rounds_off, config.policy, failed)
    if any(caps) and probe_due and could_pay(len(caps), measured, config, has_drafts=has_drafts):
        # failed_probes is reset when speculation comes back
        after = ProbeState(speculating=False, rounds_off=0, failed_probes=failed + 1)
        probe_ks = [min(config.policy.probe_k, cap) for cap in caps]
        if group_would_speculate(len(caps), measured, config):
            return probe_ks, after
        able = [i for i, cap in enumerate(caps) if cap]
        scouts = sorted(able, key=lambda i: last_drafted_steps[i])[:SCOUT_REQUESTS]
        return [k if i in scouts else 0 for i, k in enumerate(probe_ks)], after
    return ks, ProbeState(speculating=False, rounds_off=rounds_off, failed_probes=failed)
