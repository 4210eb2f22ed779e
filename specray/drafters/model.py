"""Draft-model drafting: a smaller (or cheaper) causal LM sharing the target's tokenizer.

Per round and request: re-synchronise the draft's KV cache with the committed tokens (roll
back what the target rejected, feed what it committed), then run k single-token steps for all
requests at once. Each step's q come from one batched logits pass (bit-identical to each
request's own LogitsPipeline, history at that position) and go through the wire encoding; the
tokens are sampled from exactly those decoded q with the requests' keyed DRAFT draws, in one
inverse-CDF pass read once.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from specray.drafters.base import DraftBlock, DraftRequest
from specray.models.runner import ModelRunner
from specray.sampling import (
    DraftProbsEncoding,
    EncodedDraftProbs,
    Purpose,
    decode_draft_probs,
    encode_draft_probs,
    sample_from_probs,
    stack_rows,
)
from specray.sampling.batch_pipeline import BatchLogitsPipeline, raw_argmax_rows, raw_greedy
from specray.sampling.encoding import POINT_MASS_ENCODING, SparseDraftProbs, point_mass_rows
from specray.sampling.rng import keyed_uniforms, seed_tensor
from specray.sampling.rows import memory_order


class VocabularyMismatchError(ValueError):
    """The draft's vocabulary is not the target's; verification would compare different ids."""


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target_size: int, draft_size: int):
    """Refuse a draft whose vocabulary differs from the target's, with a clear error."""
    if draft_size != target_size:
        raise VocabularyMismatchError(
            f"draft vocabulary has {draft_size} tokens but the target's has {target_size}: "
            "a draft must share the target's tokenizer"
        )
    both = draft_tokenizer is not None and target_tokenizer is not None
    if both and draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise VocabularyMismatchError(
            "draft tokenizer maps tokens to different ids than the target's: "
            "a draft must share the target's tokenizer"
        )


def _common_prefix(left: Sequence[int], right: Sequence[int]) -> int:
    size = min(len(left), len(right))
    for index in range(size):
        if left[index] != right[index]:
            return index
    return size


@dataclass
class DraftProfile:
    """Where draft time goes (seconds, summed over the drafter's life; for benchmarks)."""

    steps: int = 0  # single-token draft forwards (one per drafted position, all requests)
    tokens: int = 0  # draft tokens proposed
    forward_s: float = 0.0  # the model: decoder layers and head (head_s of it)
    head_s: float = 0.0
    pipeline_s: float = 0.0  # the request's logits pipeline -> q
    sample_s: float = 0.0  # wire encoding of q and the keyed draw


class ModelDrafter:
    def __init__(
        self,
        runner: ModelRunner,
        encoding: DraftProbsEncoding,
        *,
        keep_encoded: bool = False,
        shares_target_architecture: bool = False,
    ):
        self.runner = runner
        # A self-draft (the target's weights at another precision) can adopt the target's
        # prompt cache instead of prefilling itself.
        self.shares_target_architecture = shares_target_architecture
        self.vocab_size = runner.vocab_size
        self.encoding = encoding
        # In process, fp32 q needs no wire form; a draft worker keeps the bytes it sends.
        self.keep_encoded = keep_encoded or encoding.name != "fp32"
        self._cached: dict[Hashable, list[int]] = {}  # tokens in the draft KV cache, per request
        self._batch_pipeline = BatchLogitsPipeline()  # every request's q in one pass per step
        self.profile = DraftProfile()

    def import_prefill(self, target_runner: ModelRunner, requests: Sequence[DraftRequest]) -> None:
        """Start requests from the target's prompt cache (self-drafts share the architecture):
        skips the draft's own prefill, which at bf16 costs ~4x the target's on CPU. The draft
        is still whatever it computes from then on, so exactness is untouched."""
        fresh = [
            r for r in requests if r.request_id not in self.runner and r.request_id in target_runner
        ]
        self.runner.import_rows(target_runner, [r.request_id for r in fresh])
        for request in fresh:
            self._cached[request.request_id] = list(request.prompt_token_ids[:-1])

    def prefill(self, requests: Sequence[DraftRequest], source: ModelRunner | None = None) -> None:
        """Cache every committed token but the last of new requests (a round feeds the last).
        With ``source`` (a runner of the same architecture, e.g. the target's weights in fp32,
        whose prefill is ~4x faster than bf16 on CPU) the cache is computed there and adopted:
        the draft is only a proposal, so exactness is untouched."""
        fresh = [r for r in requests if r.request_id not in self.runner]
        feeds = {r.request_id: r.token_ids[:-1] for r in fresh if len(r.token_ids) > 1}
        if source is None:
            self.runner.forward(feeds, {})
        else:
            source.forward(feeds, {})
            self.runner.import_rows(source, list(feeds))
            source.remove(list(feeds))
        for request in fresh:
            self._cached[request.request_id] = list(request.token_ids[:-1])

    def _sync(self, request: DraftRequest) -> list[int]:
        """Roll the cache back to the committed tokens; return the committed tokens to feed."""
        committed = request.token_ids
        cached = self._cached.setdefault(request.request_id, [])
        keep = min(_common_prefix(cached, committed), len(committed) - 1)  # feed >= 1 token
        if request.request_id in self.runner:
            self.runner.rollback(request.request_id, len(cached) - keep)
        del cached[keep:]
        return committed[keep:]

    def _forward(self, feeds: dict[Hashable, list[int]]) -> dict[Hashable, torch.Tensor]:
        """One draft step: append ``feeds`` to the cache; logits ``[1, vocab]`` of the last."""
        return self.runner.forward(feeds, {request_id: 1 for request_id in feeds})

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftBlock]:
        feeds = {request.request_id: self._sync(request) for request in requests}
        proposals: dict[Hashable, list[int]] = {request.request_id: [] for request in requests}
        probs: dict[Hashable, list[torch.Tensor]] = {request.request_id: [] for request in requests}
        # A greedy request's q is a point mass at each of its tokens: its ids on q's device.
        points: dict[Hashable, list[torch.Tensor]] = {r.request_id: [] for r in requests}
        encoded: dict[Hashable, list[EncodedDraftProbs]] = {r.request_id: [] for r in requests}
        for step in range(max(request.num_tokens for request in requests)):
            if step > 0:  # feed the token drafted at the previous step
                feeds = {
                    request.request_id: proposals[request.request_id][-1:]
                    for request in requests
                    if request.num_tokens > step
                }
            profile, head_before = self.profile, self.runner.head_s
            started = time.perf_counter()
            logits = self._forward(feeds)
            profile.forward_s += time.perf_counter() - started
            profile.head_s += self.runner.head_s - head_before
            profile.steps += 1
            stepping = [request for request in requests if request.request_id in logits]
            # In the order of their rows in the forward's logits: read in place, not copied.
            order = memory_order([logits[request.request_id] for request in stepping])
            stepping = [stepping[i] for i in order]
            started = time.perf_counter()
            rows, greedy_ids = self._step_probs(stepping, logits, proposals)
            piped = time.perf_counter()
            if rows is None:
                # Every q is one-hot: its token is the argmax (what a draw from it gives), its
                # wire form that id; no vocabulary row is encoded, decoded or searched.
                tokens = torch.cat(greedy_ids).tolist()
                sent = point_mass_rows(tokens, self.vocab_size) if self.keep_encoded else None
            else:  # sample from exactly what is sent: decode(encode(q))
                sent = self._encode_step(stepping, rows) if self.keep_encoded else None
                if sent is not None:  # decoded row by row, as the receiver does; one copy back
                    rows = torch.cat([decode_draft_probs(row) for row in sent]).to(rows.device)
                tokens = self._sample(stepping, rows, step)
            if sent is not None:
                for request, row in zip(stepping, sent, strict=True):
                    encoded[request.request_id].append(row)
            for index, request in enumerate(stepping):
                self._cached[request.request_id].extend(feeds[request.request_id])
                proposals[request.request_id].append(tokens[index])
                if greedy_ids[index] is not None:
                    points[request.request_id].append(greedy_ids[index])
                else:
                    probs[request.request_id].append(rows[index])
            profile.pipeline_s += piped - started
            profile.sample_s += time.perf_counter() - piped
            profile.tokens += len(stepping)
        return [
            DraftBlock(
                proposals[r.request_id],
                SparseDraftProbs.point_masses(torch.cat(points[r.request_id]), self.vocab_size)
                if points[r.request_id]
                else torch.stack(probs[r.request_id]),  # [n, vocab]
                stack_rows(encoded[r.request_id]) if encoded[r.request_id] else None,
            )
            for r in requests
        ]

    def _step_probs(
        self, requests, logits, proposals
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """This step's q in one logits pass: every request's q ``[n, vocab]`` float32 (a fresh
        tensor: its rows are kept; a greedy request's row one-hot at its argmax), or None when
        every request is greedy (each q is the point mass at its argmax); and each greedy
        request's argmax id ``[1]`` (None for a sampled one). Row i's history is request i's
        committed output plus its drafts so far."""
        if raw_greedy([r.pipeline for r in requests]):
            # Nothing processes these logits: each q is the point mass at the raw argmax.
            return None, raw_argmax_rows([logits[r.request_id] for r in requests])
        histories = [[*r.output_token_ids, *proposals[r.request_id]] for r in requests]
        rows = self._batch_pipeline(
            [r.pipeline for r in requests],
            [logits[r.request_id] for r in requests],  # [1, vocab] each
            histories,
            [()] * len(requests),
        )
        greedy = [request.pipeline.params.greedy for request in requests]
        ids = [row if is_greedy else None for is_greedy, row in zip(greedy, rows, strict=True)]
        if all(greedy):  # each row is its argmax id [1]
            return None, ids
        out = torch.zeros(len(requests), self.vocab_size, device=rows[0].device)  # [n, vocab]
        for index, (is_greedy, row) in enumerate(zip(greedy, rows, strict=True)):
            if is_greedy:  # argmax id [1]: q is one-hot there
                out[index].scatter_(0, row, 1.0)
            else:
                out[index] = row[0]
        return out, ids

    def _encode_step(self, requests, rows: torch.Tensor) -> list[EncodedDraftProbs]:
        """Each request's q of this step in wire form, one message a row: a greedy request's
        one-hot q as a point mass (its id: the same q in 8 bytes, not a vocabulary row), the
        others in the drafter's encoding; one copy to the host for each kind."""
        greedy = [request.pipeline.params.greedy for request in requests]
        kinds = (
            (POINT_MASS_ENCODING, [i for i, is_greedy in enumerate(greedy) if is_greedy]),
            (self.encoding, [i for i, is_greedy in enumerate(greedy) if not is_greedy]),
        )
        sent: list[EncodedDraftProbs | None] = [None] * len(requests)
        for encoding, indices in kinds:
            if not indices:
                continue
            picked = rows if len(indices) == len(requests) else rows[indices]  # [m, vocab]
            encoded = encode_draft_probs(picked, encoding)
            for row, index in enumerate(indices):
                sent[index] = encoded.row(row)
        return sent

    def _sample(self, requests, rows: torch.Tensor, step: int) -> list[int]:
        """Each request's token from its q, with its keyed DRAFT draw at its output position:
        one inverse-CDF pass for the step and one read of the tokens (a greedy q is one-hot,
        so the draw decides nothing there)."""
        device = rows.device
        seeds = seed_tensor([r.random.seed for r in requests], device)
        positions = [[len(r.output_token_ids) + step] for r in requests]
        position_ids = torch.tensor(positions, dtype=torch.int64, device=device)  # [n, 1]
        uniforms = keyed_uniforms(seeds, position_ids, Purpose.DRAFT)[:, 0]  # [n]
        return sample_from_probs(rows, uniforms).tolist()

    def release(self, request_ids: Sequence[Hashable]) -> None:
        self.runner.remove(request_ids)
        for request_id in request_ids:
            self._cached.pop(request_id, None)
