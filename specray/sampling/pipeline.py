"""The one transform from raw logits + token history to a probability distribution.

Draft and target both call :meth:`LogitsPipeline.probs`, so every distribution used for a
decision (draft sampling, acceptance, residual, bonus) comes from the same rules (docs/design.md
1.1). History-dependent rules see the history *at that position*: the prompt, the committed
output, and the candidate tokens before the position.

Order of operations (each step a no-op when its parameter is at the default):
  1. logit bias, then the allowed / banned masks (-inf); at output positions before
     ``min_tokens``, the stop ids too (EOS unless ignore_eos, and stop_token_ids)
  2. repetition penalty (prompt + output tokens), presence and frequency penalties (output)
  3. greedy: one-hot at the argmax (ties -> lowest id); otherwise
  4. temperature, 5. min-p, 6. top-k (ties at the k-th value kept), 7. top-p, 8. softmax

On a CPU, steps 4-8 of a request whose only step after temperature is top-k run as a softmax
over the top candidates (:mod:`specray.sampling.top_k`): the same distribution, without a pass
over the row per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specray.sampling.argmax import row_argmax
from specray.sampling.grammar import GrammarMatcher, Grammars, unpack_masks
from specray.sampling.params import SamplingParams
from specray.sampling.top_k import takes_candidates, top_k_probs

NEG_INF = float("-inf")


def additive_entries(
    params: SamplingParams, vocab_size: int
) -> tuple[float, dict[int, float]] | None:
    """Step 1 as ``(fill, entries)``: the additive term is ``fill`` on every token except
    ``entries`` (token id -> value); None when it is zero everywhere (the step is skipped).

    Logit bias, then -inf outside the allowed set and on banned ids. Example: vocab 4,
    ``allowed_token_ids=(1, 2)``, ``banned_token_ids=(2,)``, ``logit_bias={1: 0.5, 3: 9}``
    -> ``(-inf, {1: 0.5})``, the dense term ``[-inf, 0.5, -inf, -inf]``.
    """
    banned = set(params.banned_token_ids or ())
    allowed = params.allowed_token_ids
    if allowed is not None and len(allowed) < vocab_size:  # ids are unique and in range
        fill = NEG_INF
        entries = {t: params.logit_bias.get(t, 0.0) for t in allowed if t not in banned}
    else:
        fill = 0.0
        entries = dict(params.logit_bias)
        entries.update(dict.fromkeys(banned, NEG_INF))
    if fill == 0.0 and not any(entries.values()):
        return None
    return fill, entries


@dataclass(frozen=True)
class _DeviceParts:
    """A request's static tensors on one device (built there on first use)."""

    additive: torch.Tensor | None  # [vocab] float32, step 1's term; None: skipped
    early_additive: torch.Tensor | None  # [vocab] float32, the term before min_tokens
    in_prompt: torch.Tensor | None  # [vocab] bool, prompt tokens (repetition penalty only)
    # 0-dim float32 divisors on the device: CUDA turns a division by a Python number into a
    # multiplication by its reciprocal (not always the same float), the batched pass divides
    # by a tensor; dividing by a tensor here keeps the two bit-identical on every device.
    temperature: torch.Tensor  # []
    repetition_penalty: torch.Tensor  # []


def _dense_term(term: tuple[float, dict[int, float]], vocab_size: int, device) -> torch.Tensor:
    """A step-1 term ``(fill, {id: value})`` as a ``[vocab]`` float32 tensor."""
    fill, entries = term
    dense = torch.full((vocab_size,), fill, device=device)
    ids = torch.tensor(list(entries), dtype=torch.int64, device=device)
    dense[ids] = torch.tensor(list(entries.values()), dtype=torch.float32, device=device)
    return dense


class LogitsPipeline:
    """Per-request logits processing; holds the parts that do not change during a request.

    The reference for :class:`specray.sampling.batch_pipeline.BatchLogitsPipeline`, which
    gives bit-identical results for many requests in one pass.
    """

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        prompt_token_ids: Sequence[int] = (),
        stop_token_ids: Sequence[int] | None = None,
        grammars: Grammars | None = None,
    ):
        """``stop_token_ids``: what ends this request (EOS unless ignore_eos, and
        ``params.stop_token_ids``; None: the latter alone), masked before ``min_tokens``.
        ``grammars``: this process's compiler, for a request with ``structured_outputs``
        (without one its mask is not applied: a drafter may go without, the target may not)."""
        params.check_vocab(vocab_size)
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids holds {bad[0]}, outside the vocabulary [0, {vocab_size})"
            )
        self.params = params
        self.vocab_size = vocab_size
        self.additive = additive_entries(params, vocab_size)  # (fill, {id: value}) or None
        stop = (params.stop_token_ids or ()) if stop_token_ids is None else stop_token_ids
        # The term of the rows before min_tokens: step 1's with the stop ids at -inf.
        self.early_additive = None
        if params.min_tokens > 0 and stop:
            fill, entries = self.additive or (0.0, {})
            self.early_additive = (fill, {**entries, **dict.fromkeys(sorted(stop), NEG_INF)})
        # Tokens of the prompt, for the repetition penalty only (sorted, unique).
        self.prompt_token_set: tuple[int, ...] = (
            tuple(sorted(set(prompt_token_ids))) if params.repetition_penalty != 1.0 else ()
        )
        self.uses_output_history = (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )
        self._device_parts: dict[torch.device, _DeviceParts] = {}
        self.grammar: GrammarMatcher | None = None  # step 0: the grammar's mask
        if params.structured_outputs is not None and grammars is not None:
            if grammars.vocab_size != vocab_size:
                raise ValueError(
                    f"the grammar compiler covers {grammars.vocab_size} tokens, the model "
                    f"{vocab_size}"
                )
            self.grammar = grammars.matcher(*params.structured_outputs)

    @property
    def plain(self) -> bool:
        """Its processed logits are the raw ones in float32: no bias, mask, penalty or
        grammar (a greedy request's token is then the argmax of its raw logits)."""
        return (
            self.additive is None
            and self.early_additive is None
            and not self.uses_output_history
            and self.grammar is None
        )

    def device_parts(self, device: torch.device) -> _DeviceParts:
        """The static tensors on ``device``, built there once."""
        parts = self._device_parts.get(device)
        if parts is not None:
            return parts
        params, in_prompt = self.params, None
        additive, early = (
            None if term is None else _dense_term(term, self.vocab_size, device)
            for term in (self.additive, self.early_additive)
        )
        if params.repetition_penalty != 1.0:
            in_prompt = torch.zeros(self.vocab_size, dtype=torch.bool, device=device)
            prompt = torch.tensor(self.prompt_token_set, dtype=torch.int64, device=device)
            in_prompt[prompt] = True
        parts = _DeviceParts(
            additive,
            early,
            in_prompt,
            torch.tensor(params.temperature, dtype=torch.float32, device=device),
            torch.tensor(params.repetition_penalty, dtype=torch.float32, device=device),
        )
        self._device_parts[device] = parts
        return parts

    def _output_counts(
        self,
        num_rows: int,
        output_token_ids: Sequence[int],
        candidate_token_ids: Sequence[int],
        device: torch.device,
    ) -> torch.Tensor:
        """Occurrences of each token in the output history of each row, ``[rows, vocab]``.

        Row j counts the committed output plus ``candidate_token_ids[:j]``.
        """
        base = torch.zeros(self.vocab_size, dtype=torch.float32, device=device)
        if output_token_ids:
            base.index_add_(
                0,
                torch.tensor(list(output_token_ids), dtype=torch.int64, device=device),
                torch.ones(len(output_token_ids), device=device),
            )
        counts = base.repeat(num_rows, 1)  # [rows, vocab]
        for row in range(1, num_rows):
            counts[row:, candidate_token_ids[row - 1]] += 1
        return counts

    def rows_before_min_tokens(self, num_output_tokens: int, rows: int) -> int:
        """How many of ``rows`` consecutive rows, the first at output position
        ``num_output_tokens``, come before ``min_tokens`` (0 when nothing is masked)."""
        if self.early_additive is None:
            return 0
        return min(max(self.params.min_tokens - num_output_tokens, 0), rows)

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
        if self.grammar is not None:  # step 0: what the grammar forbids after each row's history
            packed = self.grammar.masks(output_token_ids, candidate_token_ids, rows)  # [rows, W]
            allowed = unpack_masks(packed.to(out.device), self.vocab_size)  # [rows, vocab]
            out = out.masked_fill(~allowed, NEG_INF)
        parts = self.device_parts(out.device)
        early = self.rows_before_min_tokens(len(output_token_ids), rows)
        if early:  # rows at output positions before min_tokens: the stop ids masked too
            late = out[early:] if parts.additive is None else out[early:] + parts.additive
            out = torch.cat([out[:early] + parts.early_additive, late])
        elif parts.additive is not None:
            out = out + parts.additive
        if not self.uses_output_history:
            return out
        params = self.params
        counts = self._output_counts(
            rows, output_token_ids, candidate_token_ids, out.device
        )  # [rows, vocab]
        if params.repetition_penalty != 1.0:
            seen = (counts > 0) | parts.in_prompt  # [rows, vocab]
            penalty = parts.repetition_penalty
            penalised = torch.where(out > 0, out / penalty, out * penalty)
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
        return row_argmax(self.processed_logits(logits, output_token_ids, candidate_token_ids))

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
            return one_hot.scatter_(-1, row_argmax(out)[:, None], 1.0)
        temperature = None
        if params.temperature != 1.0:
            temperature = self.device_parts(out.device).temperature
        if takes_candidates(params, self.vocab_size, out.device):  # top-k only, on a CPU
            if temperature is not None:
                temperature = temperature.expand(out.shape[0], 1)  # [rows, 1]
            return top_k_probs(out, temperature, params.top_k).write(torch.zeros_like(out))
        if temperature is not None:
            out = out / temperature
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
