"""Verification rules of speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

Glossary, for one request and one round with ``k`` draft tokens:
  - *accepted* tokens: the longest prefix of the draft block that the rule keeps;
  - *recovered* token: at the first rejected position j, a token sampled from the residual
    ``normalize(max(0, target_probs[j] - draft_probs[j]))`` (greedy: the target's argmax);
  - *bonus* token: when all k drafts are accepted, a token sampled from ``target_probs[k]``.
Each round commits the accepted tokens plus exactly one recovered or bonus token (1..k+1).

Stochastic rule: accept draft token d at position j iff ``u_accept[j] < min(1, p(d) / q(d))``.
With u uniform this accepts with probability min(1, p/q); together with the residual, each
committed token follows the target distribution exactly, whatever q is (any q with q(d) > 0
for the drafted d).

Greedy rule (temperature 0): accept while d == argmax p (ties -> lowest id); at the first
mismatch commit argmax p; after k accepted, commit argmax of the last row (the bonus).
Output is token-identical to target-only greedy decoding.

All arithmetic on probabilities is float64.

Worked example (k = 1, vocabulary of 2): p = [0.6, 0.4], q = [0.2, 0.8], draft d = 1.
Accept with min(1, 0.4 / 0.8) = 0.5; on rejection the residual is max(0, p - q) = [0.4, 0],
so the recovered token is 0. P(token 0) = q(0)·1 + q(1)·0.5·1 = 0.2 + 0.4 = 0.6 = p(0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specray.sampling.argmax import row_argmax
from specray.sampling.limits import MAX_SPEC_LEN
from specray.sampling.rng import KeyedRandom, Purpose, keyed_uniforms, sample_from_probs

PLACEHOLDER_TOKEN_ID = -1  # pads token rows past each request's committed tokens
# A residual with less mass than this means p == q up to rounding: rejection had probability
# ~0, so the recovered token is drawn from p itself (the limit of the residual rule).
DEGENERATE_RESIDUAL_MASS = 1e-12


@dataclass(frozen=True)
class VerifyUniforms:
    """The uniform draws one round may consume (not all are used)."""

    accept: torch.Tensor  # [batch, k] float64, one per draft position
    residual: torch.Tensor  # [batch, k] float64, used only at the first rejected position
    bonus: torch.Tensor  # [batch] float64, used only when every draft token is accepted

    @staticmethod
    def draw(rng: torch.Generator | KeyedRandom, k: int, first_position: int = 0):
        """Uniforms for one request (batch of 1): from a generator, or keyed by position.

        With a :class:`KeyedRandom`, draft position j is output position ``first_position + j``
        and the bonus is at ``first_position + k``.
        """
        if isinstance(rng, KeyedRandom):
            positions = range(first_position, first_position + k)
            accept = rng.uniforms(positions, Purpose.ACCEPT)
            residual = rng.uniforms(positions, Purpose.RESIDUAL)
            bonus = rng.uniforms([first_position + k], Purpose.BONUS)
        else:
            draws = torch.rand(2 * k + 1, generator=rng, dtype=torch.float64)
            accept, residual, bonus = draws[:k], draws[k : 2 * k], draws[2 * k :]
        return VerifyUniforms(accept[None], residual[None], bonus)

    @staticmethod
    def draw_round(
        seeds: torch.Tensor,  # [batch] int64, from rng.seed_tensor
        first_positions: torch.Tensor,  # [batch] int64, output position of draft token 0
        num_draft_tokens: torch.Tensor,  # [batch] int64
        k: int,
        device: torch.device | str | None = None,
    ) -> VerifyUniforms:
        """A whole round's uniforms, all requests at once (one keyed draw for the three
        purposes), keyed as :meth:`draw` keys them: accept and residual at ``first + j``,
        bonus at ``first + num_draft``. Entries past a request's draft tokens are drawn, never
        read."""
        device = first_positions.device if device is None else device
        first_positions = first_positions.to(device)
        offsets = torch.arange(k, dtype=torch.int64, device=device)  # [k]
        drafted = first_positions[:, None] + offsets  # [batch, k]
        bonus = (first_positions + num_draft_tokens.to(device))[:, None]  # [batch, 1]
        positions = torch.cat([drafted, drafted, bonus], dim=1)  # [batch, 2k + 1]
        # [2k + 1], filled on the device (a host list would be a copy that waits for it)
        purposes = torch.cat(
            [
                torch.full((k,), int(purpose), dtype=torch.int64, device=device)
                for purpose in (Purpose.ACCEPT, Purpose.RESIDUAL)
            ]
            + [torch.full((1,), int(Purpose.BONUS), dtype=torch.int64, device=device)]
        )
        draws = keyed_uniforms(seeds, positions, purposes, device=device)  # [batch, 2k + 1]
        return VerifyUniforms(draws[:, :k], draws[:, k : 2 * k], draws[:, 2 * k])


@dataclass(frozen=True)
class VerifyResult:
    """One request's round: ``token_ids`` are the committed tokens, ``[num_accepted + 1]``."""

    token_ids: torch.Tensor  # [num_accepted + 1] int64: accepted drafts, then recovered/bonus
    num_accepted: int


@dataclass(frozen=True)
class BatchVerifyResult:
    token_ids: torch.Tensor  # [batch, k + 1] int64, PLACEHOLDER_TOKEN_ID past num_tokens
    num_accepted: torch.Tensor  # [batch] int64

    @property
    def num_tokens(self) -> torch.Tensor:  # [batch]
        return self.num_accepted + 1

    def row(self, index: int) -> VerifyResult:
        num_accepted = int(self.num_accepted[index])
        return VerifyResult(self.token_ids[index, : num_accepted + 1].clone(), num_accepted)


def _check_inputs(draft_token_ids, num_draft_tokens, draft_probs, target_probs) -> None:
    batch, k = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    if k > MAX_SPEC_LEN:
        raise ValueError(f"k must be <= MAX_SPEC_LEN={MAX_SPEC_LEN}, got {k}")
    if target_probs.shape != (batch, k + 1, vocab):
        raise ValueError(
            f"target_probs must have shape {(batch, k + 1, vocab)}, got {tuple(target_probs.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (batch, k, vocab):
        raise ValueError(
            f"draft_probs must have shape {(batch, k, vocab)}, got {tuple(draft_probs.shape)}"
        )
    _check_num_draft(num_draft_tokens, batch, k)
    valid = torch.arange(k)[None, :] < num_draft_tokens[:, None]  # [batch, k]
    if bool(((draft_token_ids < 0) | (draft_token_ids >= vocab))[valid].any()):
        raise ValueError(f"draft_token_ids must be in [0, {vocab}), got {draft_token_ids.tolist()}")


def _check_num_draft(num_draft_tokens: torch.Tensor, batch: int, k: int) -> None:
    if num_draft_tokens.shape != (batch,) or bool(
        ((num_draft_tokens < 0) | (num_draft_tokens > k)).any()
    ):
        raise ValueError(f"num_draft_tokens must be in [0, {k}], got {num_draft_tokens.tolist()}")


def _normalise(probs: torch.Tensor) -> torch.Tensor:
    """Rows as float64 summing to 1 (all-zero padding rows stay zero)."""
    probs = probs.double()
    return probs / probs.sum(dim=-1, keepdim=True).clamp(min=1e-300)


def _first_rejection(accepted: torch.Tensor, num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """Index of the first False per row, capped at num_draft_tokens: ``[batch, k] -> [batch]``."""
    batch, k = accepted.shape
    device = accepted.device
    if k == 0:
        return torch.zeros(batch, dtype=torch.int64, device=device)
    valid = torch.arange(k, device=device)[None, :] < num_draft_tokens[:, None]
    rejected = (~accepted) | (~valid)  # positions past the block count as a stop
    first = torch.where(rejected.any(dim=1), rejected.to(torch.int8).argmax(dim=1), k)
    return torch.minimum(first, num_draft_tokens)


def _assemble(draft_token_ids, num_accepted, final_token) -> BatchVerifyResult:
    batch, k = draft_token_ids.shape
    device = draft_token_ids.device
    columns = torch.arange(k + 1, device=device)[None, :]  # [1, k+1]
    padded = torch.cat([draft_token_ids, draft_token_ids.new_zeros(batch, 1)], dim=1)
    token_ids = torch.where(columns < num_accepted[:, None], padded, PLACEHOLDER_TOKEN_ID)
    token_ids[torch.arange(batch, device=device), num_accepted] = final_token
    return BatchVerifyResult(token_ids, num_accepted)


def verify_batch_greedy(
    draft_token_ids: torch.Tensor,  # [batch, k] int64
    num_draft_tokens: torch.Tensor,  # [batch] int64, draft tokens valid per row (<= k)
    target_probs: torch.Tensor,  # [batch, k + 1, vocab] (or logits: only the argmax is used)
) -> BatchVerifyResult:
    """Greedy rule for many requests at once (see module docstring)."""
    _check_inputs(draft_token_ids, num_draft_tokens, None, target_probs)
    # [batch, k+1], the first maximum (the lowest id) as argmax gives it
    batch, width, vocab = target_probs.shape
    argmax = row_argmax(target_probs.reshape(batch * width, vocab)).view(batch, width)
    return verify_batch_greedy_ids(draft_token_ids, num_draft_tokens, argmax)


def verify_batch_greedy_ids(
    draft_token_ids: torch.Tensor,  # [batch, k] int64
    num_draft_tokens: torch.Tensor,  # [batch] int64, draft tokens valid per row (<= k)
    target_argmax: torch.Tensor,  # [batch, k + 1] int64, the target's greedy token per position
    *,
    validate: bool = True,
) -> BatchVerifyResult:
    """The greedy rule from the target's argmax ids alone: the fast path, with no
    vocabulary-sized tensor (only the argmax of each row decides a greedy round).
    ``validate=False`` trusts ``num_draft_tokens`` (built by the caller from the blocks it
    holds): no host synchronisation."""
    batch, k = draft_token_ids.shape
    if tuple(target_argmax.shape) != (batch, k + 1):
        raise ValueError(
            f"target_argmax must have shape {(batch, k + 1)}, got {tuple(target_argmax.shape)}"
        )
    if validate:
        _check_num_draft(num_draft_tokens, batch, k)
    accepted = draft_token_ids == target_argmax[:, :-1]
    num_accepted = _first_rejection(accepted, num_draft_tokens)  # [batch]
    rows = torch.arange(len(num_accepted), device=num_accepted.device)
    final_token = target_argmax[rows, num_accepted]
    return _assemble(draft_token_ids, num_accepted, final_token)


def greedy_committed(draft_token_ids: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """The greedy rule for one request on the host, from the target's argmax ids alone
    (``len(draft_token_ids) + 1`` of them): the accepted drafts, then the target's token at the
    first mismatch, or its bonus after the last draft. What :func:`verify_batch_greedy_ids`
    computes for a row, for a caller that reads the argmax ids to the host anyway (a round's
    committed tokens end there): a few list comparisons instead of a dozen tensor kernels.
    E.g. drafts [5, 7, 9], argmax [5, 7, 2, 4] -> [5, 7, 2]."""
    if len(target_argmax) != len(draft_token_ids) + 1:
        raise ValueError(
            f"target_argmax must have {len(draft_token_ids) + 1} ids (one per draft and the "
            f"bonus), got {len(target_argmax)}"
        )
    accepted = 0
    for drafted, target in zip(draft_token_ids, target_argmax, strict=False):
        if drafted != target:
            break
        accepted += 1
    return [*draft_token_ids[:accepted], target_argmax[accepted]]


def verify_batch(
    draft_token_ids: torch.Tensor,  # [batch, k] int64
    num_draft_tokens: torch.Tensor,  # [batch] int64, draft tokens valid per row (<= k)
    draft_probs: torch.Tensor,  # [batch, k, vocab], the exact q each draft token came from
    target_probs: torch.Tensor,  # [batch, k + 1, vocab]
    uniforms: VerifyUniforms,
) -> BatchVerifyResult:
    """Stochastic rule for many requests at once (see module docstring).

    Rows with ``num_draft_tokens == 0`` are plain target sampling: only their bonus draw is
    used, and no acceptance draw decides anything for them.
    """
    _check_inputs(draft_token_ids, num_draft_tokens, draft_probs, target_probs)
    batch, k = draft_token_ids.shape
    for name, expected in (("accept", (batch, k)), ("residual", (batch, k)), ("bonus", (batch,))):
        if tuple(getattr(uniforms, name).shape) != expected:
            raise ValueError(
                f"uniforms.{name} must have shape {expected}, "
                f"got {tuple(getattr(uniforms, name).shape)}"
            )
    # float32 rows sum to 1 +- 1e-7; renormalise in float64 so p and q are exact distributions.
    target_probs = _normalise(target_probs)  # [batch, k+1, vocab] float64
    draft_probs = _normalise(draft_probs)  # [batch, k, vocab] float64
    rows = torch.arange(batch, device=draft_token_ids.device)
    valid = torch.arange(k, device=draft_token_ids.device)[None, :] < num_draft_tokens[:, None]
    vocab = target_probs.shape[-1]
    safe_ids = draft_token_ids.clamp(0, vocab - 1)[..., None]  # [batch, k, 1], padding is unused
    target_at_draft = target_probs[:, :k].gather(-1, safe_ids).squeeze(-1)  # [batch, k]
    draft_at_draft = draft_probs.gather(-1, safe_ids).squeeze(-1)  # [batch, k]
    if bool((draft_at_draft <= 0)[valid].any()):
        raise ValueError("draft_probs must be positive at every drafted token (q(d) > 0)")
    accept_probs = torch.clamp(target_at_draft / draft_at_draft.clamp(min=1e-300), max=1.0)
    accepted = uniforms.accept < accept_probs  # [batch, k]
    num_accepted = _first_rejection(accepted, num_draft_tokens)  # [batch]

    # Final token: recovered from the residual where a draft was rejected, else bonus from p.
    rejected = num_accepted < num_draft_tokens  # [batch]
    final_target = target_probs[rows, num_accepted]  # [batch, vocab]
    final_probs = final_target.clone()
    final_uniform = uniforms.bonus.clone()  # [batch]
    if bool(rejected.any()):
        at = num_accepted.clamp(max=max(k - 1, 0))
        residual = (final_target - draft_probs[rows, at]).clamp(min=0.0)  # [batch, vocab]
        degenerate = residual.sum(dim=-1) <= DEGENERATE_RESIDUAL_MASS  # p == q up to rounding
        use_residual = rejected & ~degenerate
        final_probs = torch.where(use_residual[:, None], residual, final_probs)
        final_uniform = torch.where(rejected, uniforms.residual[rows, at], final_uniform)
    final_token = sample_from_probs(final_probs, final_uniform)
    return _assemble(draft_token_ids, num_accepted, final_token)


def verify_block(
    draft_token_ids: torch.Tensor,  # [k] int64
    draft_probs: torch.Tensor,  # [k, vocab]
    target_probs: torch.Tensor,  # [k + 1, vocab]
    *,
    rng: torch.Generator | KeyedRandom,
    greedy: bool = False,
    first_position: int = 0,
) -> VerifyResult:
    """One request's round. ``rng``: a ``torch.Generator``, or a :class:`KeyedRandom` whose
    draws are keyed by output position (draft position j is ``first_position + j``)."""
    draft_token_ids = torch.as_tensor(draft_token_ids, dtype=torch.int64).reshape(1, -1)
    k = draft_token_ids.shape[1]
    num_draft = torch.tensor([k])
    if greedy:
        return verify_batch_greedy(draft_token_ids, num_draft, target_probs[None]).row(0)
    uniforms = VerifyUniforms.draw(rng, k, first_position)
    return verify_batch(
        draft_token_ids, num_draft, draft_probs[None], target_probs[None], uniforms
    ).row(0)
