"""Top-k softmax over candidates against the dense math it replaces on a CPU.

The dense math is written out here (divide the row by the temperature, keep the values >= the
k-th, softmax over the row), as :class:`LogitsPipeline` computed it before the candidates.
"""

from __future__ import annotations

import math

import pytest
import torch

from specray.sampling import LogitsPipeline, SamplingParams
from specray.sampling.top_k import (
    LANE,
    TOPK_CHUNK,
    candidate_width,
    dense_top_k_probs,
    takes_candidates,
    top_candidates,
    top_k_probs,
    top_values,
)

CPU = torch.device("cpu")


def dense_math(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """``[n, vocab] -> [n, vocab]``: steps 4, 6 and 8 over the whole row."""
    scaled = logits / torch.tensor(temperature)
    kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
    return torch.softmax(scaled.masked_fill(scaled < kth, -math.inf), dim=-1)


def rows_of(kind: str, rows: int, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    logits = 2.0 * torch.randn(rows, vocab_size, generator=generator)
    if kind == "bf16":  # a model's logits: a few ids tie at the k-th value, within the slack
        logits = logits.to(torch.bfloat16).float()
    if kind == "few finite":  # after an allowed-ids mask: -inf almost everywhere
        finite = torch.rand(rows, vocab_size, generator=generator) < 0.005
        logits = logits.masked_fill(~finite, -math.inf)
    return logits


def value_rows(kind: str, length: int, generator: torch.Generator) -> torch.Tensor:
    """12 rows: ``normal``; ``ties`` (many lanes or chunks share their maximum); ``few finite``
    (after min-p or an allowed-ids mask: -inf almost everywhere)."""
    values = torch.randn(12, length, generator=generator)
    if kind == "ties":
        values = torch.randint(-2, 3, (12, length), generator=generator).float()
    if kind == "few finite":
        finite = torch.rand(12, length, generator=generator) < 0.002
        values = values.masked_fill(~finite, -math.inf)
    return values


@pytest.mark.parametrize("length", [5, 40, LANE * 300, LANE * 300 + 7, 10_007, 128_256])
def test_top_candidates_equal_torch_topk_and_their_ids_point_at_them(length):
    generator = torch.Generator().manual_seed(length)
    for kind in ("normal", "ties", "few finite"):
        values = value_rows(kind, length, generator)
        widths = {1, 2, 7, 100, length // (2 * LANE) - 1, length}
        for width in sorted(w for w in widths if 0 < w <= length):
            top, ids = top_candidates(values, width)
            assert torch.equal(top, torch.topk(values, width, dim=-1).values)
            assert torch.equal(values.gather(1, ids), top)
            assert all(len(set(row)) == width for row in ids.tolist())  # distinct ids


@pytest.mark.parametrize("vocab_size", [64 * 40, 64 * 40 + 37, 10_007])
def test_top_values_over_chunks_equal_torch_topk(vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    for kind in ("normal", "ties", "few finite"):
        logits = value_rows(kind, vocab_size, generator)
        for k in (1, 2, 7, vocab_size // (TOPK_CHUNK * 4)):
            assert k * TOPK_CHUNK * 4 <= vocab_size  # the chunked path
            assert torch.equal(top_values(logits, k), torch.topk(logits, k, dim=-1).values)


def test_top_values_crowded_into_few_lanes_are_all_found():
    """The 24 largest values fill lanes 0-2 (a lane: 8 columns a stride apart), and lanes of
    those lanes one level up: picking fewer lanes than W would miss some."""
    length, width = 128_256, 20
    assert length > 2 * width * LANE  # the tournament, not one topk
    stride = length // LANE
    values = torch.randn(3, length, generator=torch.Generator().manual_seed(2))
    crowded = torch.tensor([lane + m * stride for lane in range(3) for m in range(LANE)])
    values[:, crowded] = 10.0 + torch.arange(3 * LANE, dtype=torch.float32)
    top, ids = top_candidates(values, width)
    assert torch.equal(top, torch.topk(values, width, dim=-1).values)
    assert set(ids[0].tolist()) <= set(crowded.tolist())


@pytest.mark.parametrize("kind", ["normal", "bf16", "few finite"])
@pytest.mark.parametrize("top_k, temperature", [(1, 1.0), (20, 0.8), (50, 0.8), (300, 2.5)])
def test_candidates_give_the_dense_math_with_its_support(kind, top_k, temperature):
    vocab_size = 20_000
    generator = torch.Generator().manual_seed(top_k)
    logits = rows_of(kind, 6, vocab_size, generator)
    pipeline = LogitsPipeline(SamplingParams(temperature=temperature, top_k=top_k), vocab_size)
    assert takes_candidates(pipeline.params, vocab_size, CPU)
    probs = pipeline.probs(logits, (), [0] * 5)  # [6, vocab]: no history step
    expected = dense_math(logits, temperature, top_k)
    assert torch.equal(probs > 0, expected > 0)  # the same ids survive
    assert torch.allclose(probs, expected, rtol=0, atol=1e-6)
    scale = None if temperature == 1.0 else torch.full((6, 1), temperature)
    overflow = top_k_probs(logits, scale, top_k).overflow
    kth_is_finite = logits.isfinite().sum(dim=-1) >= top_k  # else -inf: the dense math
    assert overflow.tolist() == (~kth_is_finite).nonzero().view(-1).tolist()


def test_rows_past_the_slack_take_the_dense_math_bit_for_bit():
    vocab_size, top_k = 5_000, 10
    width = candidate_width(top_k)
    generator = torch.Generator().manual_seed(4)
    logits = 2.0 * torch.randn(4, vocab_size, generator=generator)
    tied = torch.randperm(vocab_size, generator=generator)
    logits[1, tied[:width]] = 9.0  # W ids share the top value, the k-th: may tie beyond
    logits[2, tied[: width - 1]] = 9.0  # one fewer: the candidates still settle it
    logits[3, 7] = math.nan
    temperature = torch.full((4, 1), 0.7)
    result = top_k_probs(logits, temperature, top_k)
    assert result.overflow.tolist() == [1, 3]
    probs = result.write(torch.zeros(4, vocab_size))
    dense = dense_top_k_probs(logits, temperature, top_k)
    assert torch.equal(probs[1], dense[1]) and probs[3].isnan().all()  # as the dense math
    assert (probs[2] > 0).sum() == width - 1 and torch.allclose(probs[2], dense[2], atol=1e-6)


def test_worked_example_of_the_module_docstring():
    assert candidate_width(2) == 18
    logits = torch.zeros(1, 32)
    logits[0, :5] = torch.tensor([1.0, 7.0, 3.0, 7.0, 5.0])
    result = top_k_probs(logits, torch.tensor([[2.0]]), 2)
    assert result.ids[0, :5].tolist() in ([1, 3, 4, 2, 0], [3, 1, 4, 2, 0])
    assert result.overflow.numel() == 0
    probs = result.write(torch.zeros(1, 32))
    assert probs[0, 1] == probs[0, 3] == 0.5 and probs.sum() == 1.0
    logits[0, 5:21] = 7.0  # 18 sevens: W of them
    result = top_k_probs(logits, torch.tensor([[2.0]]), 2)
    assert result.overflow.tolist() == [0]
    assert torch.allclose(result.write(torch.zeros(1, 32))[0, :21].sum(), torch.tensor(1.0))
    assert (result.dense[0] > 0).sum() == 18


def test_only_top_k_requests_on_a_cpu_take_the_candidates():
    top_k = SamplingParams(temperature=0.8, top_k=50)
    assert takes_candidates(top_k, 1000, CPU)
    assert not takes_candidates(top_k, 1000, torch.device("meta"))  # other devices: dense
    assert not takes_candidates(top_k, candidate_width(50), CPU)  # W must be below the vocab
    for other in (
        SamplingParams(temperature=0.0, top_k=50),
        SamplingParams(top_k=50, top_p=0.9),
        SamplingParams(top_k=50, min_p=0.1),
        SamplingParams(temperature=0.8),
    ):
        assert not takes_candidates(other, 1000, CPU), other
