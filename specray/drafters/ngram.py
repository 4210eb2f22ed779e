"""Prompt-lookup drafting: no model, propose what followed the latest earlier occurrence of the
current suffix (Saxena 2023, "prompt lookup decoding").

q is a point mass on each proposed token. The exact rule handles it: the token is accepted
with probability p(d), and a rejection resamples from p with d removed.

Example: history ``[5, 6, 7, 9, 5, 6]`` with k = 2: the suffix ``[5, 6]`` occurred at index 0
and was followed by ``[7, 9]``, so the block is ``[7, 9]``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from specray.drafters.base import DraftBlock, DraftRequest
from specray.sampling import stack_rows
from specray.sampling.encoding import SparseDraftProbs, point_mass_rows


def find_continuation(
    token_ids: Sequence[int], num_tokens: int, *, min_ngram: int, max_ngram: int
) -> list[int]:
    """Tokens that followed the most recent earlier match of the longest suffix n-gram."""
    length = len(token_ids)
    for size in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = list(token_ids[length - size :])
        # Scan right to left for the latest earlier occurrence (not the suffix itself).
        for start in range(length - size - 1, -1, -1):
            if list(token_ids[start : start + size]) == suffix:
                follow = token_ids[start + size : start + size + num_tokens]
                if follow:
                    return list(follow)
    return []


@dataclass(frozen=True)
class NgramConfig:
    min_ngram: int = 1  # shortest suffix to look up
    max_ngram: int = 3  # longest suffix to look up (longer matches are tried first)

    def __post_init__(self) -> None:
        if self.min_ngram < 1:
            raise ValueError(f"min_ngram must be >= 1, got {self.min_ngram}")
        if self.max_ngram < self.min_ngram:
            raise ValueError(
                f"max_ngram must be >= min_ngram={self.min_ngram}, got {self.max_ngram}"
            )


class NgramDrafter:
    def __init__(
        self, vocab_size: int, config: NgramConfig = NgramConfig(), *, keep_encoded: bool = False
    ):
        self.vocab_size = vocab_size
        self.config = config
        self.keep_encoded = keep_encoded

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftBlock]:
        blocks = []
        for request in requests:
            token_ids = find_continuation(
                request.token_ids,
                request.num_tokens,
                min_ngram=self.config.min_ngram,
                max_ngram=self.config.max_ngram,
            )
            ids = torch.tensor(token_ids, dtype=torch.int64)  # [n]
            draft_probs = SparseDraftProbs.point_masses(ids, self.vocab_size)  # [n, 1]
            encoded = None
            if self.keep_encoded and token_ids:
                encoded = stack_rows(point_mass_rows(token_ids, self.vocab_size))
            blocks.append(DraftBlock(token_ids, draft_probs, encoded))
        return blocks

    def release(self, request_ids: Sequence[Hashable]) -> None:
        """Stateless: nothing to free."""
