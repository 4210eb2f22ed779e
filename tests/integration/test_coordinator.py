"""The coordinator on real Ray workers exchanging blocks over real gRPC: exactness through
pipelining, draft-ahead, adaptive k and a draft worker killed mid-run; admission; release of
worker state on cancellation and deadlines."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import ray

from specray import Engine, SamplingParams
from specray.cluster.distributed import DistributedBackend
from specray.engine_core.client import EngineCoreClient
from specray.engine_core.coordinator import CoordinatorConfig
from specray.engine_core.policy import DraftCost, PolicyConfig, VerifyCost
from specray.errors import DeadlineExceededError, OverloadedError, RequestCancelledError
from tests.helpers.tiny_models import exact_sequence_probs
from tests.statistical.test_engine_distribution import chi_square_fit

ALPHA = 0.001  # significance level of the statistical tests
PIPELINED = CoordinatorConfig(
    max_running=64,
    max_queue=1 << 20,
    num_micro_batches=2,
    num_speculative_tokens=3,
    adaptive_k=True,
    draft_ahead=True,
    draft_deadline_s=2.0,
    # GPU-like costs (verifying more tokens is nearly free, drafting is cheap), so that the
    # adaptive policy speculates and varies k with the measured acceptance.
    verify_prior=VerifyCost(0.0, 0.0, 0.0, table=((1, 0.05), (256, 0.06))),
    draft_prior=DraftCost(0.0, 0.0, table=((1, 0.002),)),
    policy=PolicyConfig(probe_every_rounds=2, probe_k=2),
)


def _sample_and_fit(engine, target_model, prompt, num_samples, length, seed_offset=0, tail=None):
    """Sample ``num_samples`` sequences; fit the last ``tail`` tokens (all by default) to the
    target's exact law (marginalised over the earlier tokens) and to a wrong law."""
    params = [
        SamplingParams(temperature=1.0, max_tokens=length, ignore_eos=True, seed=seed_offset + i)
        for i in range(num_samples)
    ]
    outputs = engine.generate([prompt] * num_samples, params)
    tail = tail or length
    samples = [tuple(output.token_ids[length - tail :]) for output in outputs]

    def law(sampling: SamplingParams) -> dict:
        marginal: dict = {}
        for sequence, prob in exact_sequence_probs(target_model, prompt, sampling, length).items():
            marginal[sequence[length - tail :]] = marginal.get(sequence[length - tail :], 0) + prob
        return marginal

    wrong = SamplingParams(temperature=0.6)
    return outputs, chi_square_fit(samples, law(params[0])), chi_square_fit(samples, law(wrong))


def _kill_draft_worker_after(engine, committed: int, killed: threading.Event) -> None:
    """Kill the draft worker once the engine core has committed ``committed`` tokens: mid-run
    however fast the machine runs (a timer fired after a fast run had ended)."""
    deadline = time.monotonic() + 120
    while engine.engine_stats()["stats"]["committed_tokens"] < committed:
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)
    ray.kill(engine.backend.drafts[0], no_restart=True)
    killed.set()


def test_pipelined_adaptive_sampling_follows_the_target_through_a_draft_kill(cluster, tiny_pair):
    """n = 2000 sequences of length 4, seeds 0..1999, chi-square at ALPHA = 0.001 against the
    target's exact law, through 2 micro-batches, adaptive k, draft-ahead and a draft worker
    killed mid-run (after 2000 of the 8000 tokens); the same samples must be rejected against
    temperature 0.6 (negative control)."""
    target_model, target_dir, draft_dir = tiny_pair
    engine = Engine(target_dir, draft=draft_dir, cluster=cluster[0].address, coordinator=PIPELINED)
    try:
        killed = threading.Event()
        killer = threading.Thread(target=_kill_draft_worker_after, args=(engine, 2000, killed))
        killer.start()
        outputs, fit, control = _sample_and_fit(engine, target_model, [1, 2, 3, 1], 2000, 4)
        killer.join(timeout=10)
        assert killed.is_set(), "the draft worker was not killed mid-run"
        core = engine.engine_stats()
        failures = core["stats"]["draft_failures"]
        exported = _samples(core["metrics"].decode())
    finally:
        engine.shutdown()
    print(f"pipelined + kill: {fit.describe()}; control {control.describe()}")
    assert failures == 1, "the draft worker was killed mid-run"
    assert fit.impossible_count == 0 and fit.p_value > ALPHA, fit.describe()
    assert control.p_value < ALPHA, "negative control must be rejected"
    steps = sum(output.metrics.num_target_steps for output in outputs)
    drafted = sum(output.metrics.num_draft_tokens for output in outputs)
    assert sum(output.metrics.num_accepted_tokens for output in outputs) > 0
    assert 0 < drafted < 3 * steps, "k varied between 0 and 3"
    # Prometheus counters carry vLLM's names and agree with the per-request metrics.
    label = '{model_name="default"}'
    totals = {
        "num_drafts": sum(o.metrics.num_drafts for o in outputs),
        "num_draft_tokens": drafted,
        "num_accepted_tokens": sum(o.metrics.num_accepted_tokens for o in outputs),
    }
    for name, total in totals.items():
        assert exported[f"specray:spec_decode_{name}_total{label}"] == total
    first_position = (
        'specray:spec_decode_num_accepted_tokens_per_pos_total{model_name="default",position="0"}'
    )
    assert exported[first_position] == sum(
        o.metrics.accepted_per_position[0] for o in outputs if o.metrics.accepted_per_position
    )
    assert exported[f"specray:generation_tokens_total{label}"] == 4 * len(outputs)
    assert exported[f"specray:draft_worker_restarts_total{label}"] == 1
    assert 0 < exported[f"specray:target_busy_fraction{label}"] <= 1
    assert exported[f"specray:verify_latency_seconds_count{label}"] > 0


def _samples(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {series: value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out


def test_draft_ahead_sampling_follows_the_target(cluster, tiny_pair):
    """One micro-batch, fixed k = 1, draft-ahead on: drafts made while a block was verified are
    reused when their assumed history was committed (under the engine core a verdict travels
    with the next command, so the worker folds it in at that command). n = 2000 sequences of
    length 6, seeds
    10000..11999; chi-square at ALPHA = 0.001 of the last 3 tokens (where drafts made ahead are
    verified; the first round runs target-only while the draft takes the request on) against
    the target's exact marginal law; negative control as above."""
    target_model, target_dir, draft_dir = tiny_pair
    config = CoordinatorConfig(
        max_running=16,
        max_queue=1 << 20,
        num_micro_batches=1,
        num_speculative_tokens=1,
        adaptive_k=False,
        draft_ahead=True,
        draft_ahead_min_hit=0.0,  # before every verdict too, whatever the acceptance
    )
    engine = Engine(target_dir, draft=draft_dir, cluster=cluster[0].address, coordinator=config)
    try:
        _, fit, control = _sample_and_fit(engine, target_model, [4, 0], 2000, 6, 10_000, tail=3)
        reused = engine.engine_stats()["stats"]["reused_tokens"]
    finally:
        engine.shutdown()
    print(f"draft-ahead: {fit.describe()}; control {control.describe()}; reused {reused}")
    assert reused > 0, "some drafts made ahead were kept"
    assert fit.impossible_count == 0 and fit.p_value > ALPHA, fit.describe()
    assert control.p_value < ALPHA, "negative control must be rejected"


def test_greedy_identity_with_many_concurrent_requests_of_different_lengths(cluster):
    prompts = [
        "Write a haiku about the sea.",
        "Name three primary colors.",
        "def fibonacci(n):",
        "Summarize: the cat sat on the mat.",
        "What is 2 + 2?",
        "List four fruits.",
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=4 + 3 * index, ignore_eos=True)
        for index in range(len(prompts))
    ]
    reference = Engine("default", draft=None).generate(prompts, params)
    config = CoordinatorConfig(
        num_micro_batches=2, num_speculative_tokens=4, draft_ahead=True, draft_deadline_s=5.0
    )
    # The fp32 self-draft batches well on CPU (bf16 does not) and keeps this test short.
    engine = Engine("default", draft="self:fp32", cluster=cluster[0].address, coordinator=config)
    try:
        outputs = engine.generate(prompts, params)
    finally:
        engine.shutdown()
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    assert [len(o.token_ids) for o in outputs] == [p.max_tokens for p in params]


@pytest.fixture(scope="module")
def tiny_backend(cluster, tiny_pair):
    backend = DistributedBackend(tiny_pair[1], tiny_pair[2])
    yield backend
    backend.shutdown()


class _Runner:
    """The engine core on the backend's rank 0 with one config, and a session on it."""

    def __init__(self, backend: DistributedBackend, config: CoordinatorConfig):
        self.backend = backend
        self.client = EngineCoreClient(backend.start_engine(config))
        self.submit, self.abort = self.client.submit, self.client.abort

    def stats(self) -> dict:
        return self.backend.engine_stats()["stats"]

    def stop(self) -> None:
        self.client.close()
        ray.get(self.backend.leader.stop_engine_core.remote(drain=True))


def _coordinator(backend, **overrides) -> _Runner:
    return _Runner(backend, CoordinatorConfig(**({"num_speculative_tokens": 2} | overrides)))


def _held_now(backend) -> tuple[list[str], list[str]]:
    return ray.get(backend.leader.held_requests.remote()), ray.get(
        backend.drafts[0].held_requests.remote()
    )


def _held(backend, timeout_s: float = 10.0) -> tuple[list[str], list[str]]:
    """What the workers hold once releases in flight have arrived (a draft worker frees a
    request with its next command from the engine core, a network hop away)."""
    deadline = time.monotonic() + timeout_s
    while (held := _held_now(backend)) != ([], []) and time.monotonic() < deadline:
        time.sleep(0.05)
    return held


def test_full_queue_refuses_at_once(tiny_backend):
    runner = _coordinator(tiny_backend, max_running=1, max_queue=2)
    long = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=1)
    try:
        streams = [runner.submit([1, 2], long, request_id=f"q{i}") for i in range(3)]
        started = time.monotonic()
        with pytest.raises(OverloadedError, match="queue is full"):
            runner.submit([1, 2], long, request_id="q3").result(timeout_s=0.5)
        assert time.monotonic() - started < 0.5, "refused at once"
        assert all(len(stream.result().token_ids) == 40 for stream in streams)
        # Capacity came back: the next request is admitted and served.
        assert len(runner.submit([1, 2], long, request_id="q4").result().token_ids) == 40
    finally:
        runner.stop()
    assert _held(tiny_backend) == ([], [])


def test_cancel_and_deadline_release_worker_state(tiny_backend):
    runner = _coordinator(tiny_backend, max_running=4)
    long = SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True, seed=2)
    # 1000 tokens take several seconds here, so this request cannot finish before its deadline
    # however fast drafting gets (60 tokens took about 0.4 s: too close).
    longest = SamplingParams(temperature=1.0, max_tokens=1000, ignore_eos=True, seed=3)
    try:
        cancelled = runner.submit([1, 2, 3], long, request_id="cancel-me")
        expiring = runner.submit([3, 2, 1], longest, request_id="expire-me", timeout_s=0.4)
        survivor = runner.submit([2, 2], long, request_id="keep-me")
        first = next(iter(cancelled))
        assert first.token_ids, "it was running"
        deadline = time.monotonic() + 10  # the draft takes new requests on in the background
        while "cancel-me" not in _held_now(tiny_backend)[1] and time.monotonic() < deadline:
            time.sleep(0.05)
        target_held, draft_held = _held_now(tiny_backend)
        assert "cancel-me" in target_held and "cancel-me" in draft_held
        runner.abort("cancel-me")
        with pytest.raises(RequestCancelledError):
            cancelled.result()
        with pytest.raises(DeadlineExceededError, match="deadline"):
            expiring.result()
        deadline = time.monotonic() + 10  # (the draft frees them with its next command)
        while time.monotonic() < deadline:
            target_held, draft_held = _held_now(tiny_backend)
            if not {"cancel-me", "expire-me"} & {*target_held, *draft_held}:
                break
            time.sleep(0.05)
        for request_id in ("cancel-me", "expire-me"):
            assert request_id not in target_held and request_id not in draft_held
        assert len(survivor.result().token_ids) == 60
    finally:
        runner.stop()
    assert _held(tiny_backend) == ([], [])


# Verifying more than one token per request costs 10x a step: the policy never speculates.
NEVER_PAYS = dict(
    verify_prior=VerifyCost(0.0, 0.0, 0.0, table=((1, 0.05), (2, 0.5), (256, 64.0))),
    draft_prior=DraftCost(0.0, 0.0, table=((1, 0.002),)),
)


def _seeded_run(backend, *, reproducible: bool, costs: dict, crowd: int):
    """One seeded request (temperature 1, 24 tokens), alone or beside ``crowd`` others."""
    runner = _coordinator(
        backend,
        num_speculative_tokens=3,
        max_running=8,
        num_micro_batches=1,
        reproducible_seeds=reproducible,
        **costs,
    )
    seeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=5)
    other = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    try:
        streams = [runner.submit([2, 3, 1], other, request_id=f"c{i}") for i in range(crowd)]
        output = runner.submit([1, 2, 3], seeded, request_id="seeded").result()
        for stream in streams:
            stream.result()
    finally:
        runner.stop()
    return output


def test_seeded_requests_reproduce_whatever_the_load_and_the_policy(tiny_backend):
    """reproducible_seeds: a seeded sampled request gives the same 24 tokens alone, with costs
    under which the policy speculates (GPU-like, as PIPELINED), and beside 6 other requests
    with costs under which it never does; it drafted in both. Negative control: without the
    flag the two runs take different schedules, and their tokens differ."""
    gpu_like = {"verify_prior": PIPELINED.verify_prior, "draft_prior": PIPELINED.draft_prior}
    alone = _seeded_run(tiny_backend, reproducible=True, costs=gpu_like, crowd=0)
    crowded = _seeded_run(tiny_backend, reproducible=True, costs=NEVER_PAYS, crowd=6)
    assert alone.token_ids == crowded.token_ids
    assert alone.metrics.num_draft_tokens > 0 and crowded.metrics.num_draft_tokens > 0
    # the same fixed schedule: 3 drafts a round after the first, fewer near max_tokens
    assert alone.metrics.num_draft_tokens == crowded.metrics.num_draft_tokens
    adaptive = _seeded_run(tiny_backend, reproducible=False, costs=gpu_like, crowd=0)
    target_only = _seeded_run(tiny_backend, reproducible=False, costs=NEVER_PAYS, crowd=6)
    assert target_only.metrics.num_draft_tokens == 0 < adaptive.metrics.num_draft_tokens
    assert adaptive.token_ids != target_only.token_ids, "negative control: schedules matter"
    assert _held(tiny_backend) == ([], [])


def _chunked_run(backend, budget: int):
    """A 50-token prompt joins two decoding requests; seeded sampling under reproducible_seeds
    (tokens depend on the seed alone) and greedy, on the real workers."""
    runner = _coordinator(
        backend,
        num_speculative_tokens=3,
        num_micro_batches=1,
        reproducible_seeds=True,
        max_prefill_tokens_per_round=budget,
        verify_prior=PIPELINED.verify_prior,
        draft_prior=PIPELINED.draft_prior,
    )
    decoding = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=7)
    long_prompt = [(3 * i + 1) % 5 for i in range(50)]
    try:
        running = [runner.submit([1, 2], decoding, request_id=f"d{i}") for i in range(2)]
        next(iter(running[0]))  # decoding before the long prompt arrives
        sampled = runner.submit(
            long_prompt, SamplingParams(temperature=1.0, max_tokens=12, seed=3), request_id="s"
        )
        greedy = runner.submit(
            long_prompt[::-1], SamplingParams(temperature=0.0, max_tokens=12), request_id="g"
        )
        outputs = [sampled.result(), greedy.result(), *(stream.result() for stream in running)]
        stats = runner.stats()
    finally:
        runner.stop()
    return outputs, stats["target_prefill_tokens"], stats["prefill_chunks"]


def test_chunked_prefill_gives_the_same_tokens(tiny_backend):
    """Two 50-token prompts prefilled 8 tokens a round (shared: 13 rounds) beside decoding
    requests give the tokens they give prefilled whole: seeded sampling, greedy, and the
    decoding requests' own; every prompt token is prefilled exactly once either way."""
    chunked, chunked_prefill, chunks = _chunked_run(tiny_backend, budget=8)
    whole, whole_prefill, no_chunks = _chunked_run(tiny_backend, budget=0)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]
    assert chunked_prefill == whole_prefill == 2 * 49 + 2 * 1
    # 98 tokens, 8 a round: 12 rounds end mid-prompt (the first prompt's 6, the second's 6
    # while it waits or goes on: a request-round each), none when prompts go whole.
    assert chunks >= 12 and no_chunks == 0
    assert chunked[0].metrics.num_draft_tokens > 0, "it speculated after its prefill"
    assert _held(tiny_backend) == ([], [])


def test_new_requests_are_prefilled_in_the_verification_forward(tiny_backend, tiny_pair):
    """Requests joining decoding ones cache their prompts in the round's one forward (no
    prefill forward of their own) and get the tokens the in-process engine gives them, which
    prefills apart; one that scores its prompt (prompt logprobs) is prefilled apart, with the
    same scores."""
    runner = _coordinator(tiny_backend, num_speculative_tokens=2, num_micro_batches=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    scored = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    prompts = [[(3 * i + 1) % 5 for i in range(30)], [(2 * i + 3) % 5 for i in range(20)]]
    try:
        before = runner.stats()["fused_prefill_tokens"]
        running = [runner.submit([1, 2], greedy, request_id=f"d{i}") for i in range(2)]
        next(iter(running[0]))  # decoding before the others arrive
        joined = [
            runner.submit(prompt, greedy, request_id=f"j{i}") for i, prompt in enumerate(prompts)
        ]
        asking = runner.submit(prompts[0], scored, request_id="scored")
        outputs = [stream.result() for stream in (*joined, asking, *running)]
        fused = runner.stats()["fused_prefill_tokens"] - before
    finally:
        runner.stop()
    # Every context token but the scored prompt's: the prompts less their pending tokens.
    assert fused == (30 - 1) + (20 - 1) + 2 * (2 - 1)
    local = Engine(tiny_pair[1], draft=tiny_pair[2], num_speculative_tokens=2)
    expected = local.generate([*prompts, prompts[0]], [greedy, greedy, scored])
    assert [o.token_ids for o in outputs[:3]] == [o.token_ids for o in expected]
    assert [(p.token_id, round(p.logprob, 4)) for p in outputs[2].prompt_logprobs[1:]] == [
        (p.token_id, round(p.logprob, 4)) for p in expected[2].prompt_logprobs[1:]
    ]
    assert _held(tiny_backend) == ([], [])


def test_cancel_mid_chunked_prefill_releases_worker_state(tiny_backend):
    """A 400-token prompt prefilled 2 tokens a round (200 rounds) is cancelled while the
    target holds part of it: the target and the draft worker free it; a request decoding
    beside it finishes."""
    runner = _coordinator(tiny_backend, num_micro_batches=1, max_prefill_tokens_per_round=2)
    decoding = SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True, seed=4)
    try:
        survivor = runner.submit([1, 2], decoding, request_id="keep-me")
        long = runner.submit([1, 2, 3, 4] * 100, decoding, request_id="long")
        deadline = time.monotonic() + 10
        while not runner.stats()["prefill_chunks"] and time.monotonic() < deadline:
            time.sleep(0.01)  # until the target has cached a first chunk
        assert "long" in _held_now(tiny_backend)[0]
        # mid-prefill: a first chunk cached, nothing decoded (199 more rounds of chunks to go)
        assert runner.stats()["prefill_chunks"] >= 1 and not long.token_ids
        runner.abort("long")
        with pytest.raises(RequestCancelledError):
            long.result()
        assert len(survivor.result().token_ids) == 60
    finally:
        runner.stop()
    assert _held(tiny_backend) == ([], [])


def _target_only_run(backend, params, *, async_scheduling: bool, cancel: str | None = None):
    """Every request at once through a fresh engine core drafting nothing (k = 0), one
    micro-batch; ``cancel``: abort that request once it has streamed tokens. Returns the
    outputs (None for the cancelled one) and the engine core's stats."""
    runner = _coordinator(
        backend,
        num_speculative_tokens=0,
        num_micro_batches=1,
        max_running=16,
        async_scheduling=async_scheduling,
    )
    try:
        streams = [
            runner.submit([1 + i % 3, 2, 3], p, request_id=f"r{i}") for i, p in enumerate(params)
        ]
        outputs = []
        for i, stream in enumerate(streams):
            if f"r{i}" == cancel:
                next(iter(stream))
                runner.abort(cancel)
                with pytest.raises(RequestCancelledError):
                    stream.result()
                outputs.append(None)
                continue
            outputs.append(stream.result())
        stats = runner.stats()
    finally:
        runner.stop()
    return outputs, stats


def test_async_scheduling_gives_the_same_tokens_and_skips_ended_requests(tiny_backend):
    """Target-only rounds queued before the verdict of the running one: greedy and seeded
    sampled requests of different lengths give the same tokens as rounds built after it; one
    ending on a stop token mid-batch has its queued row skipped by the target (counted), and
    one cancelled while rounds are queued is freed. Control: without async scheduling no round
    is queued ahead."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(3)
    ] + [
        SamplingParams(temperature=1.0, max_tokens=8 + 7 * i, ignore_eos=True, seed=10 + i)
        for i in range(3)
    ]
    probe, _ = _target_only_run(tiny_backend, params, async_scheduling=False)
    # A token the sixth request first draws at its seventh position or later, as a stop token:
    # it ends there, rounds after its prefill (when rounds are being queued ahead).
    tokens = probe[5].token_ids
    end = next(j for j in range(6, len(tokens)) if tokens[j] not in tokens[:j])
    params[5] = replace(params[5], stop_token_ids=[tokens[end]])
    reference, sync_stats = _target_only_run(tiny_backend, params, async_scheduling=False)
    outputs, stats = _target_only_run(tiny_backend, params, async_scheduling=True)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    assert [o.finish_reason for o in outputs] == [o.finish_reason for o in reference]
    assert reference[5].finish_reason == "stop" and len(reference[5].token_ids) == end + 1
    assert stats["rounds_ahead"] > 0 and sync_stats["rounds_ahead"] == 0
    assert stats["rows_ended"] >= 1, "the stop token's request was in a queued round"
    assert _held(tiny_backend) == ([], [])

    long = [*params[:5], SamplingParams(temperature=1.0, max_tokens=400, ignore_eos=True)]
    cancelled, cancel_stats = _target_only_run(
        tiny_backend, long, async_scheduling=True, cancel="r5"
    )
    assert [o.token_ids for o in cancelled[:5]] == [o.token_ids for o in reference[:5]]
    assert cancel_stats["rounds_ahead"] > 0
    assert _held(tiny_backend) == ([], [])


def _late_run(backend, *, async_scheduling: bool):
    """Two requests decode; five more are submitted one by one while they do."""
    runner = _coordinator(
        backend, num_speculative_tokens=0, num_micro_batches=1, async_scheduling=async_scheduling
    )
    early = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    late = [
        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=20 + i)
        for i in range(5)
    ]
    try:
        first = [runner.submit([1, 2, 3 + i], early, request_id=f"e{i}") for i in range(2)]
        stream = iter(first[0])
        for _ in range(3):
            next(stream)  # rounds are running (and, with async scheduling, queued ahead)
        joiners = []
        for i, params in enumerate(late):
            joiners.append(runner.submit([3, 2, i % 5], params, request_id=f"l{i}"))
            time.sleep(0.003)
        outputs = [s.result() for s in (*first, *joiners)]
        stats = runner.stats()
    finally:
        runner.stop()
    return outputs, stats


def test_requests_submitted_while_rounds_are_queued_join_them_exactly(tiny_backend):
    """Requests submitted while rounds are queued ahead (joining the queued round if the
    target has not started it, else the next): their tokens, greedy and seeded, are those of
    rounds built after the verdict. (Whether one joins depends on timing: this model's round
    takes about a millisecond. The simulator's test counts a join.)"""
    outputs, stats = _late_run(tiny_backend, async_scheduling=True)
    reference, sync_stats = _late_run(tiny_backend, async_scheduling=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    assert stats["rounds_ahead"] > 0 and sync_stats["joined_ahead"] == 0
    assert _held(tiny_backend) == ([], [])
