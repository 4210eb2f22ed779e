"""BatchLogitsPipeline against the per-request LogitsPipeline: bit-identical (torch.equal).

The reference is :class:`LogitsPipeline` (greedy requests: ``greedy_token_ids``, sampled ones:
``probs``), run request by request on the same logits and histories.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace
from functools import cache

import pytest
import torch

from specray.sampling import LogitsPipeline, SamplingParams, SamplingParamsError
from specray.sampling.batch_pipeline import BatchLogitsPipeline, SamplingMetadata
from specray.sampling.grammar import Grammars
from specray.sampling.top_k import (
    TOPK_CHUNK,
    candidate_width,
    takes_candidates,
    top_k_probs,
)

NUM_SETS = 320  # random request sets in the equality test
CPU = torch.device("cpu")
# Structured outputs over a made-up vocabulary (token i's text from ALPHABET; the last id is
# the stop token): grammars whose masks depend on the history, one that completes.
ALPHABET = "0123456789ab() "
GRAMMARS = [
    ("regex", r"[0-9ab]*"),
    ("regex", r"(\(a*\)|b|1)*"),
    ("choice", '["0a", "ab()", "b"]'),
    ("json_object", ""),
]


@cache
def grammars_for(vocab_size: int) -> Grammars:
    texts = [ALPHABET[i % len(ALPHABET)] * (1 + i // len(ALPHABET) % 3) for i in range(vocab_size)]
    return Grammars.for_vocab(texts, [vocab_size - 1])


def random_params(rng: random.Random, vocab_size: int) -> SamplingParams:
    """Each parameter at its default or not; the non-default values include the edges."""
    values: dict = {}
    if rng.random() < 0.3:
        values["temperature"] = rng.choice([0.0, 1e-6])  # greedy
    elif rng.random() < 0.7:
        values["temperature"] = rng.choice([0.8, 0.5, 2.0, rng.uniform(0.05, 3.0)])
    if rng.random() < 0.45:
        values["top_k"] = rng.choice([1, 2, 5, rng.randint(1, vocab_size + 2)])
    if rng.random() < 0.35:
        values["top_p"] = rng.choice([rng.uniform(0.05, 1.0), 0.9, 1e-9, 5e-324])
    if rng.random() < 0.25:
        values["min_p"] = rng.choice([rng.uniform(0.0, 0.5), 0.1, 1.0])
    if rng.random() < 0.3:
        values["repetition_penalty"] = rng.choice([rng.uniform(0.5, 2.0), 1.3])
    for name in ("presence_penalty", "frequency_penalty"):
        if rng.random() < 0.25:
            values[name] = rng.choice([rng.uniform(-2.0, 2.0), 0.5, -0.0])
    if rng.random() < 0.3:
        ids = rng.sample(range(vocab_size), rng.randint(1, min(4, vocab_size)))
        values["logit_bias"] = {t: rng.choice([rng.uniform(-100, 100), 0.0, 5.0]) for t in ids}
    if rng.random() < 0.2:
        size = rng.choice([1, rng.randint(1, vocab_size), vocab_size])
        values["allowed_token_ids"] = rng.sample(range(vocab_size), size)
    if rng.random() < 0.2:
        values["banned_token_ids"] = rng.sample(range(vocab_size), rng.randint(1, vocab_size - 1))
    if rng.random() < 0.25:  # outputs of 0-8 tokens, 1-5 rows: rows before, across and after
        values["min_tokens"] = rng.randint(1, 12)
    try:
        return SamplingParams(**values)
    except SamplingParamsError:  # banned covers every allowed id: keep the allowed set only
        values.pop("banned_token_ids")
        return SamplingParams(**values)


def random_logits(rng: random.Random, rows: int, vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    kind = rng.choice(["normal", "ties", "zeros"])
    if kind == "normal":
        return torch.randn(rows, vocab_size, generator=generator) * rng.choice([1.0, 4.0])
    # Few distinct values: ties at the k-th value, at the argmax, at the top-p cut.
    logits = torch.randint(-3, 4, (rows, vocab_size), generator=generator) * 0.5
    if kind == "zeros":  # signed zeros too
        negative = torch.rand(rows, vocab_size, generator=generator) < 0.3
        logits = torch.where(negative, torch.full_like(logits, -0.0), logits)
    return logits.to(torch.float32)


def random_request_set(rng: random.Random):
    vocab_size = rng.choice([37, 500, rng.randint(2, 200), 4099])  # 4099: top-k over chunks
    size = rng.randint(1, 6)
    pipelines, logits, outputs, candidates = [], [], [], []
    for _ in range(size):
        params = random_params(rng, vocab_size)
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 6))]
        stop = rng.sample(range(vocab_size), rng.randint(1, min(3, vocab_size - 1) or 1))
        grammars = None
        if vocab_size > 2 and not params.min_tokens and rng.random() < 0.15:
            # (refused beside a grammar: they may take every token it allows)
            params = replace(
                params,
                allowed_token_ids=None,
                banned_token_ids=None,
                structured_outputs=rng.choice(GRAMMARS),
            )
            grammars = grammars_for(vocab_size)
        pipelines.append(LogitsPipeline(params, vocab_size, prompt, stop, grammars))
        rows = rng.randint(1, 5)
        logits.append(random_logits(rng, rows, vocab_size))
        outputs.append([rng.randrange(vocab_size) for _ in range(rng.randint(0, 8))])
        num_candidates = rows - 1 if rng.random() < 0.8 else rows
        candidates.append([rng.randrange(vocab_size) for _ in range(num_candidates)])
    return pipelines, logits, outputs, candidates


def reference(pipelines, logits, outputs, candidates) -> list[torch.Tensor]:
    return [
        (p.greedy_token_ids if p.params.greedy else p.probs)(rows, output, cands)
        for p, rows, output, cands in zip(pipelines, logits, outputs, candidates, strict=True)
    ]


def coverage(pipelines, logits) -> Counter:
    """Which options a request set exercises (to check the random sets reach each one)."""
    seen: Counter = Counter()
    defaults = SamplingParams()
    for pipeline, rows in zip(pipelines, logits, strict=True):
        params = pipeline.params
        for name in (
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "allowed_token_ids",
            "banned_token_ids",
            "min_tokens",
            "structured_outputs",
        ):
            seen[name] += getattr(params, name) != getattr(defaults, name)
        seen["greedy"] += params.greedy
        if 0 < params.top_k < pipeline.vocab_size and not params.greedy:
            kth = torch.topk(rows, params.top_k, dim=-1).values[:, -1:]
            seen["ties at the k-th value"] += bool(((rows >= kth).sum(-1) > params.top_k).any())
            seen["top-k over chunks"] += params.top_k * TOPK_CHUNK * 4 <= pipeline.vocab_size
            seen["top-k candidates"] += takes_candidates(params, pipeline.vocab_size, CPU)
    seen["mixed"] += 0 < seen["greedy"] < len(pipelines)
    return seen


LOGPROB_FIELDS = ("logprobs", "prompt_logprobs", "logprobs_mode")


def test_batched_pass_is_bit_identical_to_the_reference():
    rng = random.Random(20)
    batch = BatchLogitsPipeline()  # one workspace over every set, as in the target core
    seen: Counter = Counter()
    for index in range(NUM_SETS):
        pipelines, logits, outputs, candidates = random_request_set(rng)
        if index % 2:  # views of one tensor, as ModelRunner.forward gives them: read in place
            logits = list(torch.cat(logits).split([rows.shape[0] for rows in logits]))
        before = [rows.clone() for rows in logits]
        expected = reference(pipelines, logits, outputs, candidates)
        got = batch(pipelines, logits, outputs, candidates)
        assert all(torch.equal(a, b) for a, b in zip(before, logits, strict=True))  # unchanged
        for request, (want, have) in enumerate(zip(expected, got, strict=True)):
            assert want.dtype == have.dtype and want.shape == have.shape
            # NaN rows (min_tokens masking the only allowed token) compare equal as NaN
            same = torch.equal(want, have) or bool((want.isnan() == have.isnan()).all())
            assert same and torch.equal(want.nan_to_num(), have.nan_to_num()), (
                index,
                request,
                pipelines[request].params,
            )
        seen += coverage(pipelines, logits)
    for option in (*SamplingParams().__dataclass_fields__, "greedy", "mixed"):
        # (the logprob fields read the pipeline's rows, they change none)
        if option in ("stop_token_ids", "ignore_eos", "max_tokens", "seed", *LOGPROB_FIELDS):
            continue
        assert seen[option] >= 20, (option, seen)
    assert seen["ties at the k-th value"] >= 10 and seen["top-k over chunks"] >= 10, seen
    assert seen["top-k candidates"] >= 20, seen


def test_flat_logits_and_bf16_give_the_same_results():
    rng = random.Random(7)
    for _ in range(20):
        pipelines, logits, outputs, candidates = random_request_set(rng)
        logits = [rows.to(torch.bfloat16) for rows in logits]
        expected = reference(pipelines, logits, outputs, candidates)
        num_rows = [rows.shape[0] for rows in logits]
        metadata = SamplingMetadata.build(pipelines, num_rows, outputs, candidates, "cpu")
        got = BatchLogitsPipeline().run(metadata, torch.cat(logits))  # [R, vocab] bf16
        for want, have in zip(expected, got, strict=True):
            assert torch.equal(want, have)


def nudged(params: SamplingParams, name: str) -> SamplingParams:
    """``params`` with ``name`` moved to the next float32 (the smallest change that exists)."""
    value = torch.tensor(getattr(params, name), dtype=torch.float32)
    moved = float(torch.nextafter(value, torch.tensor(math.inf)))
    return SamplingParams(**{**params.__dict__, name: moved, "logit_bias": params.logit_bias})


@pytest.mark.parametrize(
    "params, name",
    [
        (SamplingParams(temperature=0.8, top_k=50), "temperature"),
        (SamplingParams(frequency_penalty=0.5), "frequency_penalty"),
        (SamplingParams(repetition_penalty=1.3, temperature=0.7), "repetition_penalty"),
    ],
)
def test_negative_control_the_equality_check_sees_one_float32_step(params, name):
    """The equality test can fail: a parameter one float32 step away changes the output."""
    vocab_size = 500
    generator = torch.Generator().manual_seed(3)
    logits = [torch.randn(5, vocab_size, generator=generator) * 3 for _ in range(3)]
    outputs, candidates = [[1, 2, 2, 9]] * 3, [[4, 5, 6, 7]] * 3
    prompt = [3, 9, 11]
    pipelines = [LogitsPipeline(params, vocab_size, prompt) for _ in range(3)]
    moved = [LogitsPipeline(params, vocab_size, prompt)] * 2
    moved.insert(1, LogitsPipeline(nudged(params, name), vocab_size, prompt))
    expected = reference(pipelines, logits, outputs, candidates)
    same = BatchLogitsPipeline()(pipelines, logits, outputs, candidates)
    got = BatchLogitsPipeline()(moved, logits, outputs, candidates)
    assert all(torch.equal(want, have) for want, have in zip(expected, same, strict=True))
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[2], got[2])
    assert not torch.equal(expected[1], got[1])


def test_worked_example_of_the_module_docstring():
    greedy = LogitsPipeline(SamplingParams(temperature=0.0), 3)
    sampled = LogitsPipeline(SamplingParams(temperature=0.5, top_k=2), 3)
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0], [4.0, 1.0, 2.0]])
    ids, probs = BatchLogitsPipeline()(
        [greedy, sampled], [logits[:2], logits[2:]], [[], []], [[1], []]
    )
    assert ids.tolist() == [1, 2]
    assert probs[0, 1] == 0.0
    assert probs[0].tolist() == pytest.approx([1 / (1 + math.exp(-4)), 0.0, 0.01798621])


def test_unused_steps_are_not_in_the_metadata():
    plain = LogitsPipeline(SamplingParams(top_k=5), 50)
    for device in ("cpu", "meta"):  # on a CPU the top-k requests form a group instead
        metadata = SamplingMetadata.build([plain, plain], [3, 2], [[], [1]], [[1, 2], [3]], device)
        assert metadata.greedy_rows is None is metadata.additive is metadata.penalties
        assert metadata.temperature is None and metadata.min_p is None is metadata.top_p
        if device == "meta":
            assert metadata.dense_rows is None and metadata.top_k_groups == ()
            assert metadata.top_k.rows is None and metadata.top_k.kth_index is None  # one k
        else:
            assert metadata.top_k is None and metadata.dense_runs == ()
            (group,) = metadata.top_k_groups
            assert group.top_k == 5 and group.rows is None is group.slots is group.temperature
    greedy = LogitsPipeline(SamplingParams(temperature=0.0, presence_penalty=1.0), 50)
    nucleus = LogitsPipeline(SamplingParams(top_p=0.5), 50)
    metadata = SamplingMetadata.build(
        [greedy, nucleus, plain, nucleus], [3, 2, 1, 2], [[]] * 4, [[1, 2], [3], [], [4]], "cpu"
    )
    assert metadata.greedy_rows.tolist() == [0, 1, 2]
    assert metadata.dense_rows.tolist() == [3, 4, 6, 7]
    assert metadata.dense_runs == ((0, 0, 2), (2, 3, 2))  # the top-k row (5) between them
    assert metadata.top_k_groups[0].rows.tolist() == [5]
    assert metadata.top_k_groups[0].slots.tolist() == [2]
    assert metadata.penalties.rows.tolist() == [0, 1, 2]
    assert metadata.penalties.frequency is None and metadata.penalties.repetition is None
    assert metadata.penalties.candidate_row.tolist() == [1, 2, 2]  # row j: candidates[:j]


def test_meta_device_pass_creates_every_tensor_on_the_logits_device():
    """On the meta device a CPU tensor meeting the logits raises, and so does any read of a
    value on the host (.item(), .tolist(), bool(tensor)): the pass does neither."""
    rng = random.Random(11)
    for _ in range(30):
        pipelines, logits, outputs, candidates = random_request_set(rng)
        meta_logits = [rows.to("meta") for rows in logits]
        got = BatchLogitsPipeline()(pipelines, meta_logits, outputs, candidates)
        assert all(rows.device.type == "meta" for rows in got)
        for pipeline, rows, output, cands in zip(
            pipelines, meta_logits, outputs, candidates, strict=True
        ):
            assert pipeline.probs(rows, output, cands).device.type == "meta"


@pytest.mark.parametrize(
    "candidates, outputs, message",
    [
        ([[1]], [[]], "3 logits rows need 2 candidate tokens"),
        ([[1, 99]], [[]], "candidate_token_ids holds an id outside"),
        ([[1, 2]], [[-1]], "output_token_ids holds an id outside"),
    ],
)
def test_inputs_are_checked_up_front(candidates, outputs, message):
    pipelines = [LogitsPipeline(SamplingParams(), 10)]
    with pytest.raises(ValueError, match=message):
        BatchLogitsPipeline()(pipelines, [torch.zeros(3, 10)], outputs, candidates)


def top_k_request_set(vocab_size: int):
    """Top-k requests of several k and temperatures (one k twice, apart), over logits with
    ties (bfloat16) and with more ties at the k-th value than the slack, between requests of
    every other kind."""
    generator = torch.Generator().manual_seed(vocab_size)
    plain_k = [(1, 1.0), (20, 0.8), (50, 0.8), (7, 2.0), (50, 1.0), (300, 0.5)]
    params = [SamplingParams(temperature=t, top_k=k) for k, t in plain_k]
    params[2:2] = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
        SamplingParams(top_k=50, min_p=0.05),
        SamplingParams(temperature=0.9, top_k=20, repetition_penalty=1.3, logit_bias={3: 4.0}),
    ]
    pipelines = [LogitsPipeline(p, vocab_size, [1, 2, 3]) for p in params]
    logits = []
    for index in range(len(pipelines)):
        rows = 2.0 * torch.randn(3, vocab_size, generator=generator)
        if index % 2:
            rows = rows.to(torch.bfloat16).float()
        logits.append(rows)
    tied = torch.randperm(vocab_size, generator=generator)[: candidate_width(50)]
    logits[6][1, tied] = 7.5  # request 6 (top_k 50): W ids tie at the k-th value, row 1
    outputs = [[5, 5, 6]] * len(pipelines)
    candidates = [[7, 8]] * len(pipelines)
    return pipelines, logits, outputs, candidates


@pytest.mark.parametrize("vocab_size", [3_000, 128_256])
def test_top_k_groups_are_bit_identical_to_the_reference(vocab_size):
    pipelines, logits, outputs, candidates = top_k_request_set(vocab_size)
    flat = torch.cat(logits)  # views of one tensor, read in place
    logits = list(flat.split([rows.shape[0] for rows in logits]))
    metadata = SamplingMetadata.build(pipelines, [3] * len(logits), outputs, candidates, "cpu")
    assert [group.top_k for group in metadata.top_k_groups] == [1, 7, 20, 50, 300]
    assert metadata.dense_runs  # the greedy, top-p, min-p requests run beside the groups
    assert takes_candidates(pipelines[6].params, vocab_size, CPU)
    overflow = top_k_probs(logits[6], torch.full((3, 1), 0.8), 50).overflow
    assert overflow.tolist() == [1]  # the dense math's fallback runs too
    expected = reference(pipelines, logits, outputs, candidates)
    batch = BatchLogitsPipeline()
    for _ in range(2):  # a reused workspace holds the last round's values
        got = batch.run(metadata, logits)
        for request, (want, have) in enumerate(zip(expected, got, strict=True)):
            assert torch.equal(want, have), (request, pipelines[request].params)
    for request, pipeline in enumerate(pipelines):  # alone: the same bits
        args = [pipeline], logits[request : request + 1], outputs[:1], candidates[:1]
        assert torch.equal(batch(*args)[0], expected[request]), request


def test_plain_greedy_requests_take_the_raw_argmax_without_building_the_pass(monkeypatch):
    """Requests whose logits nothing processes (greedy, no bias, penalty, mask or grammar)
    get the raw argmax, as the reference does, without the batched pass's metadata; one
    greedy request whose bias moves its argmax takes the whole pass (the control)."""
    built = []
    build = SamplingMetadata.build
    monkeypatch.setattr(
        SamplingMetadata, "build", staticmethod(lambda *a, **k: built.append(1) or build(*a, **k))
    )
    vocab_size, generator = 300, torch.Generator().manual_seed(5)
    logits = [torch.randn(n, vocab_size, generator=generator) for n in (1, 3, 2)]
    outputs, candidates = [[4], [5, 6], []], [[], [7, 8], [9]]
    plain = [LogitsPipeline(SamplingParams(temperature=0.0), vocab_size, [1]) for _ in logits]
    expected = reference(plain, logits, outputs, candidates)
    for parts in (logits, list(torch.cat(logits).split((1, 3, 2)))):  # apart, one tensor
        got = BatchLogitsPipeline()(plain, parts, outputs, candidates)
        assert all(torch.equal(want, have) for want, have in zip(expected, got, strict=True))
    assert built == []
    banned = int(logits[1][0].argmax())
    biased = SamplingParams(temperature=0.0, logit_bias={banned: -100.0})
    mixed = [plain[0], LogitsPipeline(biased, vocab_size, [1]), plain[2]]
    got = BatchLogitsPipeline()(mixed, logits, outputs, candidates)
    assert built == [1] and int(got[1][0]) != banned
    assert all(
        torch.equal(want, have)
        for want, have in zip(reference(mixed, logits, outputs, candidates), got, strict=True)
    )


def test_plain_greedy_requests_are_checked_as_any():
    greedy = [LogitsPipeline(SamplingParams(temperature=0.0), 10) for _ in range(2)]
    with pytest.raises(ValueError, match="got 2, 1"):
        BatchLogitsPipeline()(greedy, [torch.zeros(1, 10)], [[]], [[]])
    with pytest.raises(ValueError, match="3 logits rows need 2 candidate tokens"):
        BatchLogitsPipeline()(greedy[:1], [torch.zeros(3, 10)], [[]], [[1]])
