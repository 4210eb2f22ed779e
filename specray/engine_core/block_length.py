"""The block length of each micro-batch round, and the group decisions that hang on it
(split into micro-batches or not, hand requests to the draft workers or not), as pure functions
of what the coordinator measured.

Per micro-batch and round one K comes from :func:`specray.engine_core.policy.choose_batch_k` on its
requests' measured per-position acceptance and the group's measured costs (verify time as a
function of batch and tokens, draft step time, network round trip): a round costs what its
longest block costs, so every request drafts K (fewer only near its max_tokens). K = 0 runs the
batch target-only. Probing is each request's own (a :class:`RequestProbe` it carries from round
to round): a request that never drafted is probed at its first chance, and one at k = 0 again
after ``probe_every_rounds`` of its rounds (doubling per probe that found no gain), so a
request the draft serves badly cannot hold speculation off for the requests after it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from specray.engine_core.coordinator_config import CoordinatorConfig
from specray.engine_core.policy import (
    DraftCost,
    VerifyCost,
    choose_batch_k,
    choose_k,
    predicted_tokens_per_s,
    should_probe,
)

SCOUT_REQUESTS = 2  # probes per round (and untried requests handed to the draft) while the
# group's acceptance says "do not draft"


@dataclass(frozen=True)
class Measurements:
    """What the rules read, as the coordinator measured it just now."""

    verify: VerifyCost  # the target's verification time, fitted online
    draft: DraftCost  # one draft step, fitted online
    rtt_s: float  # coordinator <-> target round trip
    group_acceptance: tuple[float, ...]  # the group's running α_1..α_num_speculative_tokens
    pipelined: bool  # more than one micro-batch holds requests now


@dataclass(frozen=True)
class RequestProbe:
    """What a request's block-length choice remembers from its earlier rounds."""

    tried: bool = False  # it has drafted (a probe, or the policy's K): it showed its acceptance
    rounds_off: int = 0  # its rounds in a row without drafts since then
    failed_probes: int = 0  # its probes in a row that did not bring speculation back


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
    num_untried: int,
    batch_size: int,
    measured: Measurements,
    config: CoordinatorConfig,
    *,
    has_drafts: bool,
) -> int:
    """How many of a micro-batch's ``num_fresh`` requests the draft workers have not seen to
    hand them now (the first ones): all while the batch would speculate; otherwise enough that
    SCOUT_REQUESTS requests wait for their first try (``num_untried`` of those the draft workers
    hold already have never drafted), and none if speculation cannot pay at this batch size.
    So every request gets its chance to show its acceptance, a few at a time. A draft prefill
    computes beside the target (on a shared host it slowed the target's rounds ~10% at
    concurrency 16 here) and is wasted on a request that never drafts. E.g. 16 requests, 15 of
    them fresh, one held and untried, the group's acceptance saying no: 1."""
    if not config.adaptive_k or group_would_speculate(batch_size, measured, config):
        return num_fresh
    if not could_pay(batch_size, measured, config, has_drafts=has_drafts):
        return 0
    return min(max(SCOUT_REQUESTS - num_untried, 0), num_fresh)


def choose_ks(
    caps: Sequence[int],
    acceptances: Sequence[Sequence[float]],
    fixed: Sequence[bool],
    probes: Sequence[RequestProbe],
    last_drafted_steps: Sequence[int],
    speculating: bool,
    measured: Measurements,
    config: CoordinatorConfig,
    *,
    has_drafts: bool,
) -> tuple[list[int], list[RequestProbe], bool]:
    """k per request of one micro-batch round, each request's probe state after it, and
    whether the micro-batch speculated (the policy's hysteresis).

    Request i may draft at most ``caps[i]`` tokens (0: not this round); ``acceptances[i]`` is
    its α_1..α_num_speculative_tokens, ``probes[i]`` its probing so far,
    ``last_drafted_steps[i]`` its step when it last drafted (0: never). The k is the policy's
    (:func:`policy_ks`), but a ``fixed`` request (speculation "on", or seeded under
    reproducible_seeds) drafts its cap every round after its first (that one prefills it on the
    target: cap 0, whatever happens)."""
    ks, probes, speculating = policy_ks(
        caps,
        acceptances,
        probes,
        last_drafted_steps,
        speculating,
        measured,
        config,
        has_drafts=has_drafts,
    )
    ks = [cap if fixed_k else k for fixed_k, cap, k in zip(fixed, caps, ks, strict=True)]
    return ks, probes, speculating


def policy_ks(
    caps: Sequence[int],
    acceptances: Sequence[Sequence[float]],
    probes: Sequence[RequestProbe],
    last_drafted_steps: Sequence[int],
    speculating: bool,
    measured: Measurements,
    config: CoordinatorConfig,
    *,
    has_drafts: bool,
) -> tuple[list[int], list[RequestProbe], bool]:
    """k per request: one block length for the batch (a round costs what its longest block
    costs), cut by each request's cap. When the batch does not speculate, the requests whose
    probe is due draft probe_k tokens, so that their acceptance is measured and speculation
    comes back when it pays: a request that never drafted at once, the others after
    ``probe_every_rounds`` of their own rounds without drafts (doubled per failed probe).

    While the group's acceptance says "do not draft", at most SCOUT_REQUESTS of them probe in
    a round (at batch 16, two more verified tokens for everyone cost 2.6x a step here): the
    untried first, then those that drafted longest ago; everyone due probes once it says yes.
    E.g. caps [4, 4, 0, 4], all due, last drafted at steps [9, 3, 0, 5], the group saying no:
    [0, 2, 0, 2]."""
    if not config.adaptive_k:
        return list(caps), list(probes), speculating
    ks = [0] * len(caps)
    if any(caps):
        block = choose_batch_k(
            acceptances,
            caps,
            verify=measured.verify,
            draft=measured.draft,
            rtt_s=measured.rtt_s,
            config=config.policy,
            speculating=speculating,
            **overlap(config, pipelined=measured.pipelined),
        )
        ks = [min(block, cap) for cap in caps]
    if any(ks):  # speculation pays: whoever drafts is back, its failed probes forgotten
        after = [
            RequestProbe(tried=True) if k else _waited(probe, cap)
            for probe, k, cap in zip(probes, ks, caps, strict=True)
        ]
        return ks, after, True
    after = [_waited(probe, cap) for probe, cap in zip(probes, caps, strict=True)]
    if not could_pay(len(caps), measured, config, has_drafts=has_drafts):
        return ks, after, False
    due = [
        i
        for i, cap in enumerate(caps)
        if cap
        and (
            not probes[i].tried
            or should_probe(after[i].rounds_off, config.policy, probes[i].failed_probes)
        )
    ]
    due.sort(key=lambda i: (probes[i].tried, last_drafted_steps[i]))
    if not group_would_speculate(len(caps), measured, config):
        due = due[:SCOUT_REQUESTS]
    for i in due:
        ks[i] = min(config.policy.probe_k, caps[i])
        # failed_probes is reset when the policy's K includes it again
        after[i] = RequestProbe(tried=True, failed_probes=probes[i].failed_probes + 1)
    return ks, after, False


def _waited(probe: RequestProbe, cap: int) -> RequestProbe:
    """A round without drafts: it counts toward the next probe if the request could draft."""
    return replace(probe, rounds_off=probe.rounds_off + 1) if cap else probe
