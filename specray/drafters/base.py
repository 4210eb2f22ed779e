"""The drafter protocol: anything that proposes a block of candidate tokens with its q.

A drafter is stateless from the engine's point of view: each call to :meth:`Drafter.propose`
carries the request's committed tokens, and a drafter that caches (a draft model's KV cache)
re-synchronises against them itself — so a retried or reordered call changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specray.sampling import EncodedDraftProbs, KeyedRandom, LogitsPipeline
from specray.sampling.encoding import SparseDraftProbs


@dataclass
class DraftRequest:
    """One request's view for one round."""

    request_id: Hashable
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # committed output so far
    pipeline: LogitsPipeline  # the request's one logits pipeline (same as the target's)
    random: KeyedRandom  # draws keyed by (seed, output position, purpose)
    num_tokens: int  # k: the most tokens to propose this round (>= 1)
    # Only for a drafter with ``needs_target_features``: row i is h_i, the target's final-norm
    # hidden state at committed position i (it gave the logits for token i + 1), for every
    # committed position but the last (the target has not run it yet). Committed rows never
    # change, so all are sent (a view, no copy); the drafter takes the ones it needs.
    target_features: torch.Tensor | None = None  # [len(token_ids) - 1, hidden] float32

    @property
    def token_ids(self) -> list[int]:
        """Prompt plus committed output: everything the target has committed."""
        return [*self.prompt_token_ids, *self.output_token_ids]


@dataclass
class DraftBlock:
    """A proposal: ``token_ids[j]`` was sampled from row j of ``draft_probs`` (exactly that q).
    A greedy request's q, or a lookup's, is a point mass at each token, kept sparse; a sampled
    request's is a dense row."""

    token_ids: list[int]  # [n], 0 <= n <= k
    draft_probs: torch.Tensor | SparseDraftProbs  # [n, vocab] float32, or [n, 1] point masses
    # The wire form q was decoded from (drafters built with keep_encoded=True): sent as is.
    encoded: EncodedDraftProbs | None = None

    @staticmethod
    def empty(vocab_size: int) -> DraftBlock:
        return DraftBlock([], torch.zeros(0, vocab_size))


class Drafter(Protocol):
    vocab_size: int

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftBlock]:
        """One block per request, in order; a block may be shorter than asked (even empty)."""
        ...

    def release(self, request_ids: Sequence[Hashable]) -> None:
        """Forget finished or cancelled requests (free their caches)."""
        ...
