"""The one transform from raw logits + token history to a probability distribution.

Draft and target both call :meth:`LogitsPipeline.probs`, so every distribution used for a
decision (draft sampling, acceptance, residual, bonus) comes from the same rules (docs/design.md
1.1). History-dependent rules see the history *at that position*: the prompt, the committed
output, and the candidate tokens before the position.

Order of operations (each step a no-op when its parameter is at the default):
  1. logit bias, then the allowed / banned masks (-inf)
  2. repetition penalty (prompt + output tokens), presence and frequency penalties (output)
  3. greedy: one-hot at the argmax (ties -> lowest id); otherwise
  4. temperature, 5. min-p, 6. top-k (ties at the k-th value kept), 7. top-p, 8. softmax
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specray.sampling.params import SamplingParams

NEG_INF = float("-inf")


class LogitsPipeline:
    """Per-request logits processing; holds the parts that do not change during a request."""

    def __init__(
        self, params: SamplingParams, vocab_size: int, prompt_token_ids: Sequence[int] = ()
    ):
        params.check_vocab(vocab_size)
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids holds {bad[0]}, outside the vocabulary [0, {vocab_size})"
            )
        self.params = params
        self.vocab_size = vocab_size
        # Static additive term: logit bias plus -inf outside the allowed set / on banned ids.
        additive = torch.zeros(vocab_size, dtype=torch.float32)  # [vocab]
        for token_id, bias in params.logit_bias.items():
            additive[token_id] = bias
        if params.allowed_token_ids is not None:
            allowed = torch.zeros(vocab_size, dtype=torch.bool)
            allowed[list(params.allowed_token_ids)] = True
            additive[~allowed] = NEG_INF
        if params.banned_token_ids:
            additive[list(params.banned_token_ids)] = NEG_INF
        self._additive = additive if additive.any() else None
        self._in_prompt = None  # [vocab] bool, tokens of the prompt (repetition penalty only)
        if params.repetition_penalty != 1.0:
            self._in_prompt = torch.zeros(vocab_size, dtype=torch.bool)
            if prompt_token_ids:
                self._in_prompt[torch.as_tensor(list(prompt_token_ids))] = True
        self._uses_output_history = (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )

    def _output_counts(
        self, num_rows: int, output_token_ids: Sequence[int], candidate_token_ids: Sequence[int]
    ) -> torch.Tensor:
        """Occurrences of each token in the output history of each row, ``[rows, vocab]``.

        Row j counts the committed output plus ``candidate_token_ids[:j]``.
        """
        base = torch.zeros(self.vocab_size, dtype=torch.float32)
        if output_token_ids:
            base.index_add_(
                0,
                torch.as_tensor(list(output_token_ids)),
                torch.ones(len(output_token_ids)),
            )
        counts = base.repeat(num_rows, 1)  # [rows, vocab]
        for row in range(1, num_rows):
            counts[row:, candidate_token_ids[row - 1]] += 1
        return counts

    def processed_logits(
        self,
        logits: torch.Tensor,
        output_token_ids: Sequence[int] = (),
        candidate_token_ids: Sequence[int] = (),
    ) -> torch.Tensor:
        """Steps 1-2: bias, masks and penalties. ``logits``: ``[rows, vocab]`` -> same shape."""
        rows = logits.shape[0]
        if not rows - 1 <= len(candidate_token_ids) <= rows:
            raise ValueError(
                f"{rows} logits rows need {rows - 1} candidate tokens (or {rows}), "
                f"got {len(candidate_token_ids)}"
            )
        out = logits.to(torch.float32)
        if self._additive is not None:
            out = out + self._additive
        if not self._uses_output_history:
            return out
        params = self.params
        counts = self._output_counts(rows, output_token_ids, candidate_token_ids)  # [rows, vocab]
        if params.repetition_penalty != 1.0:
            seen = (counts > 0) | self._in_prompt  # [rows, vocab]
            penalised = torch.where(
                out > 0, out / params.repetition_penalty, out * params.repetition_penalty
            )
            out = torch.where(seen, penalised, out)
        if params.frequency_penalty != 0.0:
            out = out - params.frequency_penalty * counts
        if params.presence_penalty != 0.0:
            out = out - params.presence_penalty * (counts > 0).to(torch.float32)
        return out

    def greedy_token_ids(
        self,
        logits: torch.Tensor,
        output_token_ids: Sequence[int] = (),
        candidate_token_ids: Sequence[int] = (),
    ) -> torch.Tensor:
        """A greedy request's token for each row, int64 ``[rows]``: the argmax of the processed
        logits (the one-hot :meth:`probs` gives, without its ``[rows, vocab]`` tensor)."""
        return self.processed_logits(logits, output_token_ids, candidate_token_ids).argmax(dim=-1)

    def probs(
        self,
        logits: torch.Tensor,
        output_token_ids: Sequence[int] = (),
        candidate_token_ids: Sequence[int] = (),
    ) -> torch.Tensor:
        """Distribution for each row, float32 ``[rows, vocab]`` (one-hot when greedy).

        logits: ``[rows, vocab]`` raw model logits for consecutive positions; row j's history is
        the prompt, ``output_token_ids`` and ``candidate_token_ids[:j]``.
        """
        out = self.processed_logits(logits, output_token_ids, candidate_token_ids)
        params = self.params
        if params.greedy:
            one_hot = torch.zeros_like(out)
            return one_hot.scatter_(-1, out.argmax(dim=-1, keepdim=True), 1.0)
        if params.temperature != 1.0:
            out = out / params.temperature
        if params.min_p > 0.0:
            probs = torch.softmax(out, dim=-1)
            threshold = params.min_p * probs.max(dim=-1, keepdim=True).values  # [rows, 1]
            out = out.masked_fill(probs < threshold, NEG_INF)
        if 0 < params.top_k < self.vocab_size:
            kth = torch.topk(out, params.top_k, dim=-1).values[:, -1:]  # [rows, 1]
            out = out.masked_fill(out < kth, NEG_INF)
        if params.top_p < 1.0:
            sorted_logits, order = torch.sort(out, dim=-1, descending=True)  # [rows, vocab]
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [rows, vocab]
            drop_sorted = mass_before >= params.top_p
            # Always keep the top token (as vLLM does): a top_p that is 0 in float32 (5e-324)
            # would otherwise drop every token. mass_before[0] is exactly 0, so valid top_p
            # values are unaffected.
            drop_sorted[:, 0] = False
            drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
            out = out.masked_fill(drop, NEG_INF)
        return torch.softmax(out, dim=-1)
