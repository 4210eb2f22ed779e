"""Top-k softmax over candidates: steps 4, 6 and 8 of :class:`~specray.sampling.pipeline.
LogitsPipeline` for a request whose only step after temperature is top-k, on a CPU.

The dense math divides every logit of the row by the temperature, finds the k-th largest
value, sets every smaller one to -inf and takes a softmax over the row: five passes over
``[rows, vocab]``. Here, on the processed logits x (steps 1-2 done) of each row:
  1. candidates: the W largest values of x (:func:`candidate_width`) with their ids,
     descending (:func:`top_candidates`: one read of the row, then top-ks over a few lanes);
  2. ``scaled = candidates / temperature``: the same float32 division of the same floats as the
     dense math's, so the same bits at those ids. Dividing by a positive number keeps the order
     (ties may appear, none disappears): the row's k-th largest scaled value is
     ``scaled[:, k-1]``, and no id outside the candidates scales above ``scaled[:, W-1]``;
  3. the survivors are the candidates ``>= scaled[:, k-1]`` (ties at the k-th value kept, as
     the dense math keeps them), a prefix. Unless ``scaled[:, W-1]`` is below the k-th value,
     an id outside the candidates might tie it: the row OVERFLOWS and takes the dense math.
     That needs the k-th value shared by more than ``W - k`` ids (or a NaN or infinite top);
  4. a softmax over the ``[rows, W]`` candidates (-inf past the survivors), scattered into
     zeroed rows.

The result is the dense math's distribution with the same support; the values differ from it
in the last bits (the softmax sums W values, not the row). :class:`LogitsPipeline` and
:class:`~specray.sampling.batch_pipeline.BatchLogitsPipeline` both call :func:`top_k_probs`,
the batch once per k over the rows of that k: W depends on k alone and every step works row by
row, so a row gets the same bits whichever rows it is run with.

Worked example: k = 2 (W = 18), temperature 2, a row of 32 logits
``[1, 7, 3, 7, 5, 0, ..., 0]`` -> candidates ``[7, 7, 5, 3, 1, 0 x 13]`` at ids
``[1, 3, 4, 2, 0, ...]``; scaled ``[3.5, 3.5, 2.5, 1.5, 0.5, 0, ...]``; the k-th value 3.5 is
above ``scaled[17] = 0``: no overflow; survivors ids 1 and 3 -> probabilities 0.5 at ids 1 and
3, 0 elsewhere. Had 16 of the zeros been 7 (W sevens), ``scaled[17]`` would be 3.5: the row
overflows, and the dense math gives each of the 18 ids 1/18.

Also here: :func:`top_values` (the dense path's k-th values) and the batch's top-k metadata
(:class:`TopK` for the dense path, :class:`TopKGroup` for the candidates).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specray.sampling.params import SamplingParams

TOPK_CHUNK = 64  # columns per chunk in top_values (a fast amax on a CPU)
LANE = 8  # columns per lane in top_candidates
MIN_SLACK = 16  # candidates beyond the k-th, at least: room for ties at the k-th value


def candidate_width(top_k: int) -> int:
    """W, the candidates of a row with this k: ``k + max(k // 4, MIN_SLACK)``.

    The slack ``W - k`` is room for ids tied with the k-th value; a row with more overflows.
    Ties grow with k (a deeper k-th value sits where values are denser): over 200 rows of
    ``2 * randn`` logits rounded to bfloat16 (vocab 128256), the ids after the k-th sharing
    its value were 1.3 on average and 5 at most for k = 50, 2.8 and 12 for k = 100, 21 and 50
    for k = 1000. Every top-k over the candidates costs time in proportion to W, hence a
    quarter of k rather than more.
    """
    return top_k + max(top_k // 4, MIN_SLACK)


def takes_candidates(params: SamplingParams, vocab_size: int, device: torch.device) -> bool:
    """Whether a request's rows take :func:`top_k_probs`: sampled, top-k its only step after
    temperature, fewer candidates than the vocabulary, on a CPU (on a GPU the dense masks are
    cheap, and the host read of the overflowing rows is a synchronisation)."""
    return (
        device.type == "cpu"
        and not params.greedy
        and params.min_p == 0.0
        and params.top_p == 1.0
        and params.top_k > 0
        and candidate_width(params.top_k) < vocab_size
    )


@dataclass(frozen=True)
class TopKProbs:
    """Probabilities of rows that take the candidates: each row's W candidates, and the rows
    that overflow, by the dense math."""

    ids: torch.Tensor  # [n, W] int64, each row's candidates
    probs: torch.Tensor  # [n, W] float32, their probabilities (every other id: 0)
    overflow: torch.Tensor  # [m] int64, the rows whose probabilities are instead ...
    dense: torch.Tensor  # [m, vocab] float32 ... these

    def write(self, out: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Into ``out`` ``[n, vocab]`` (``rows`` None) or its rows ``rows`` (``[n]`` int64),
        zero until then."""
        if rows is None:
            out.scatter_(1, self.ids, self.probs)
            return out.index_copy_(0, self.overflow, self.dense)
        out.index_put_((rows[:, None], self.ids), self.probs)
        return out.index_copy_(0, rows[self.overflow], self.dense)


def top_k_probs(logits: torch.Tensor, temperature: torch.Tensor | None, top_k: int) -> TopKProbs:
    """Steps 4, 6 and 8 of rows that take the candidates (see the module docstring).

    logits: ``[n, vocab]`` float32, steps 1-2 done, only read. temperature: ``[n, 1]`` float32
    (None: 1), divided by as a tensor, as the dense math does.
    """
    values, ids = top_candidates(logits, candidate_width(top_k))  # [n, W] each
    scaled = values if temperature is None else values / temperature  # [n, W]
    kth = scaled[:, top_k - 1 : top_k]  # [n, 1]
    # Settled: no id outside the candidates reaches the k-th value. A NaN compares false, and
    # an infinite top spreads NaN over the dense math's row: such rows take the dense math.
    settled = (scaled[:, -1:] < kth) & scaled[:, :1].isfinite()  # [n, 1]
    probs = torch.softmax(scaled.masked_fill(scaled < kth, -torch.inf), dim=-1)  # [n, W]
    overflow = (~settled).view(-1).nonzero().view(-1)  # [m], a free read on a CPU
    dense = logits.new_empty(0, logits.shape[1])
    if overflow.numel():
        if temperature is not None:
            temperature = temperature.index_select(0, overflow)
        dense = dense_top_k_probs(logits.index_select(0, overflow), temperature, top_k)
    return TopKProbs(ids, probs, overflow, dense)


def dense_top_k_probs(
    logits: torch.Tensor, temperature: torch.Tensor | None, top_k: int
) -> torch.Tensor:
    """The dense math of steps 4, 6 and 8 (the reference's): ``[n, vocab] -> [n, vocab]``."""
    scaled = logits if temperature is None else logits / temperature  # [n, vocab]
    kth = top_values(scaled, top_k)[:, -1:]  # [n, 1]
    return torch.softmax(scaled.masked_fill(scaled < kth, -torch.inf), dim=-1)


def top_candidates(values: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``width`` largest values of each row, descending, and their ids:
    ``[n, length] -> ([n, W], [n, W] int64)``. The values are exactly
    ``torch.topk(values, width).values``; among equal values the ids may differ from topk's.

    A tournament, for a row much longer than W: the columns are dealt into ``stride =
    length // LANE`` lanes (lane j: columns j, j + stride, ..., j + 7 * stride; the last
    ``length % LANE`` columns stay candidates), the W lanes with the largest maxima are found
    the same way (recursively), and one topk picks the W largest among their members. Why
    nothing is missed: were the i-th largest value v of the row (i <= W) in a lane not picked,
    whose maximum is >= v, each of the W picked lanes would have a maximum >= v: W values >= v
    are among the candidates anyway. Only values are compared, no arithmetic. Each level reads
    its input once (a vectorised max across lanes) and runs topk over ``W * LANE`` values: on
    one CPU thread, 80 rows of 128256 with W = 66 take ~5 ms, ``torch.topk`` ~14 ms.
    """
    rows, length = values.shape
    if length <= 2 * width * LANE:  # too few lanes to gain: one topk over the row
        return torch.topk(values, width, dim=-1)
    stride = length // LANE
    lanes = values[:, : LANE * stride].reshape(rows, LANE, stride).amax(dim=1)  # [n, stride]
    lane_ids = top_candidates(lanes, width)[1]  # [n, W]
    lane_columns = stride * torch.arange(LANE, device=values.device)  # [lane]
    members = (lane_ids[:, :, None] + lane_columns).view(rows, width * LANE)
    rest = torch.arange(LANE * stride, length, device=values.device).expand(rows, -1)
    candidates = torch.cat([members, rest], dim=1)  # [n, W * lane + length % lane] ids
    top, picked = torch.topk(values.gather(1, candidates), width, dim=-1)  # [n, W]
    return top, candidates.gather(1, picked)


def top_values(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest values of each row, descending, ``[n, vocab] -> [n, k]``: exactly
    ``torch.topk(logits, k).values``, in about half its time when k is small next to the vocab.

    The row is cut into chunks of ``TOPK_CHUNK`` (and a shorter tail); one topk picks the k
    chunks with the largest maxima, a second the k largest values among those chunks and the
    tail. Why nothing is missed: were the j-th largest value v of the row (j <= k) in a chunk
    not picked, whose maximum is >= v, each of the k picked chunks would have a maximum >= v:
    k values >= v are among the candidates anyway. Only values are compared, no arithmetic.
    """
    rows, vocab_size = logits.shape
    if k * TOPK_CHUNK * 4 > vocab_size:  # too few chunks to gain: one topk over the row
        return torch.topk(logits, k, dim=-1).values
    num_chunks = vocab_size // TOPK_CHUNK
    head = logits[:, : num_chunks * TOPK_CHUNK].view(rows, num_chunks, TOPK_CHUNK)
    picked = torch.topk(head.amax(dim=-1), k, dim=-1).indices  # [n, k] chunks
    chunks = head.gather(1, picked[..., None].expand(rows, k, TOPK_CHUNK))  # [n, k, chunk]
    tail = logits[:, num_chunks * TOPK_CHUNK :]  # [n, vocab % chunk]
    candidates = torch.cat([chunks.view(rows, k * TOPK_CHUNK), tail], dim=1)
    return torch.topk(candidates, k, dim=-1).values


@dataclass(frozen=True)
class TopK:
    """Step 6 (top-k, ties at the k-th value kept) on the dense path of a batch."""

    rows: torch.Tensor | None  # [n] int64, among the dense rows; None: every dense row
    kth_index: torch.Tensor | None  # [n, 1] int64, k - 1 per row; None: one k for every row
    largest_k: int  # the largest k of these rows (one torch.topk for all of them)


@dataclass(frozen=True)
class TopKGroup:
    """In a batch on a CPU, the sampled requests of one k whose rows take the candidates."""

    top_k: int
    rows: torch.Tensor | None  # [n] int64 rows of the round; None: every row
    slots: torch.Tensor | None  # [n] int64, among the sampled requests' rows; None: all
    temperature: torch.Tensor | None  # [n, 1] float32; None: 1 on every row
