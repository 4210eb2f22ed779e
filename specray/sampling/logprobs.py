"""Log-probabilities of committed tokens, read from the target's rows at verification.

A committed token at output position j was drawn from the target's row j of its round (an
accepted draft follows p exactly, a correction too), so its log-probability is read there,
whether the round speculated or not (docs/design.md section "Logprobs"). Two modes, as vLLM:

* ``raw`` — ``log_softmax`` of the model's logits (vLLM's default);
* ``processed`` — the distribution the token was drawn from: bias, masks, penalties,
  temperature, min-p, top-k/p applied (tokens they remove are ``-inf``). A greedy request
  takes the argmax of its processed logits, so there it is their ``log_softmax``.

Prompt log-probabilities (``prompt_logprobs``, and ``echo`` with ``logprobs``) are raw: the
prompt was not sampled. Everything is computed on the rows' device; a round that wants any
reads them to the host in one copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there, its log-probability and rank, and the most likely."""

    token_id: int
    logprob: float  # -inf where the processed distribution excludes it (never for a drawn one)
    rank: int  # 1 + the tokens strictly more likely
    top_ids: tuple[int, ...]  # the most likely first; as many as the request asked
    top_logprobs: tuple[float, ...]


LSE_CHUNK = 256  # entries of a row summed together (row_logsumexp)


def row_logsumexp(rows: torch.Tensor) -> torch.Tensor:
    """``[m, vocab]`` -> ``[m, 1]``: log Σ exp of each row, summed in chunks of LSE_CHUNK
    entries and then chunk by chunk, so that a row gets the same bits however many rows come
    with it (``torch.logsumexp`` splits a lone long row across threads, but not one of several
    rows, and rounds differently: a verified block's log-probabilities would differ from one
    token's at the last bit)."""
    count, vocab = rows.shape
    top = rows.amax(dim=1, keepdim=True)  # [m, 1]: exact in any order
    chunks = -(-vocab // LSE_CHUNK)
    shifted = torch.exp(rows - top)  # [m, vocab]
    if vocab % LSE_CHUNK:  # zeros (exp of -inf) up to whole chunks
        shifted = torch.nn.functional.pad(shifted, (0, chunks * LSE_CHUNK - vocab))
    sums = shifted.view(count, chunks, LSE_CHUNK).sum(dim=2).sum(dim=1, keepdim=True)
    return top + torch.log(sums)


def scored_rows(
    rows: torch.Tensor, token_ids: torch.Tensor, width: int, *, probs: bool = False
) -> torch.Tensor:
    """``rows``: ``[m, vocab]`` logits (``probs``: probabilities) of the distributions
    ``token_ids`` ``[m]`` were drawn from -> float64 ``[m, 2 + 2 * width]``: each token's
    log-probability, its rank, the ``width`` largest log-probabilities and their ids. Reads
    the rows three times (no ``[m, vocab]`` log-probabilities are made)."""
    rows = rows.to(torch.float32)
    chosen = rows.gather(1, token_ids[:, None])  # [m, 1]
    rank = (rows > chosen).sum(dim=1, keepdim=True) + 1  # [m, 1]
    top = rows.topk(width, dim=1) if width else None  # [m, width] values and ids
    values = top.values if top is not None else chosen[:, :0]
    if probs:
        chosen, values = torch.log(chosen), torch.log(values)  # 0 -> -inf
    else:
        normaliser = row_logsumexp(rows)  # [m, 1]
        chosen, values = chosen - normaliser, values - normaliser
    ids = top.indices if top is not None else token_ids[:, None][:, :0]
    # ids < 2**53: exact in float64
    return torch.cat([chosen.double(), rank.double(), values.double(), ids.double()], dim=1)


def unpack(
    host_rows: Sequence[Sequence[float]], token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprob]:
    """:func:`scored_rows` read to the host (``tolist()``) -> one entry per token, each with
    its ``num_top`` most likely (at most the width scored)."""
    out = []
    for token_id, n, row in zip(token_ids, num_top, host_rows, strict=True):
        width = (len(row) - 2) // 2
        values, indices = row[2 : 2 + n], row[2 + width : 2 + width + n]
        out.append(
            TokenLogprob(token_id, row[0], int(row[1]), tuple(map(int, indices)), tuple(values))
        )
    return out


def token_logprobs(
    rows: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int], *, probs: bool = False
) -> list[TokenLogprob]:
    """One call's worth of :func:`scored_rows` and :func:`unpack` (one copy to the host)."""
    if rows.shape[0] != len(token_ids) or len(token_ids) != len(num_top):
        raise ValueError(
            f"{rows.shape[0]} rows for {len(token_ids)} tokens and {len(num_top)} counts"
        )
    if not token_ids:
        return []
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device="cpu").to(rows.device)
    return unpack(scored_rows(rows, ids, max(num_top), probs=probs).tolist(), token_ids, num_top)
