"""The stochastic rule of :func:`specray.sampling.verify.verify_batch`, without dense q.

Same rule (``verify_batch``'s module docstring defines accepted, recovered and bonus tokens,
Leviathan et al. 2023); what differs is the data plane of a round, which touches one
vocabulary-sized row per request, the least that drawing its final token needs:

  - the target rows are distributions (the logits pipeline's softmax) and are used as given:
    ``p(d)`` is gathered at the drafted ids, no row is summed. ``verify_batch`` renormalises
    each row in float64 first; float32 rows sum to 1 within ~1e-7, so the two agree except
    where a uniform lies within that of an acceptance threshold;
  - q stays as it arrived: a sparse ``top<M>`` block is ``[n, M]`` ids and values, never a
    ``[batch, k, vocab]`` tensor; a dense block is read in place (no padded copy). q is
    normalised by its own sum (what the draft sampled from);
  - per request, the final row is copied once (float32, p at position num_accepted); a
    rejected row gets the residual ``max(0, p - q)`` written at q's M ids (computed in
    float64), and the row is sampled by
    :func:`specray.sampling.block_sampling.sample_blocked`, whose block masses normalise it;
  - every tensor lives on the target rows' device; the round reads one flag on the host
    (``validate=True`` adds one).

Worked example (vocabulary of 3, one request, k = 1): p rows ``[[0.5, 0.3, 0.2], [1, 0, 0]]``,
q sparse ``ids [[1, 2]], values [[0.6, 0.4]]``, drafted d = 1, u_accept = 0.9. The acceptance
probability is ``min(1, 0.3 / 0.6) = 0.5 <= 0.9``: rejected. The residual is built on row 0
only: ``max(0, [0.5, 0.3 - 0.6, 0.2 - 0.4]) = [0.5, 0, 0]``, so the recovered token is 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specray.sampling.block_sampling import BLOCK, block_masses, sample_blocked
from specray.sampling.encoding import SparseDraftProbs
from specray.sampling.rows import Workspace, consecutive_rows
from specray.sampling.verify import (
    DEGENERATE_RESIDUAL_MASS,
    MAX_SPEC_LEN,
    BatchVerifyResult,
    VerifyUniforms,
    _assemble,
    _first_rejection,
)

# One block's q: dense float32 [n, vocab], or sparse [n, M] ids and values.
DraftProbs = torch.Tensor | SparseDraftProbs
_TINY = 1e-300  # the floor verify_batch divides by (an all-zero padding row stays zero)


@dataclass(frozen=True)
class DraftProbsBatch:
    """The q of one round's draft tokens, all requests in one form.

    Dense: ``dense_rows[b]`` is request b's ``[num_draft_b, vocab]`` q, read in place.
    Sparse: ``token_ids`` / ``values`` stack the blocks' ``[num_draft_b, M_b]`` rows, padded
    with id 0 and value 0 (a zero value adds nothing to a sum nor subtracts from a residual).
    """

    dense_rows: tuple[torch.Tensor, ...] | None = None  # request b: [num_draft_b, vocab] float32
    token_ids: torch.Tensor | None = None  # [batch, k, M] int64
    values: torch.Tensor | None = None  # [batch, k, M] float32, rows summing to 1, 0 as padding

    @property
    def sparse(self) -> bool:
        return self.token_ids is not None

    @staticmethod
    def from_blocks(blocks: Sequence[DraftProbs], k: int, device) -> DraftProbsBatch:
        """Stack blocks of one form (empty blocks fit either) on ``device``."""
        if not any(isinstance(block, SparseDraftProbs) for block in blocks):
            return DraftProbsBatch(dense_rows=tuple(block.to(device) for block in blocks))
        if any(isinstance(block, torch.Tensor) and block.shape[0] > 0 for block in blocks):
            raise ValueError("a DraftProbsBatch holds dense or sparse blocks, not both")
        sparse = [block for block in blocks if isinstance(block, SparseDraftProbs)]
        width = max(block.values.shape[-1] for block in sparse)  # M

        def padded(block: DraftProbs, field: str, dtype: torch.dtype) -> torch.Tensor:
            if isinstance(block, torch.Tensor):  # an empty dense block: nothing drafted
                return torch.zeros(k, width, dtype=dtype, device=sparse[0].values.device)
            rows = getattr(block, field)  # [n, M_b]
            return F.pad(rows, (0, width - rows.shape[1], 0, k - rows.shape[0]))  # [k, M]

        if all(isinstance(b, SparseDraftProbs) and b.values.shape == (k, width) for b in blocks):
            token_ids = torch.stack([b.token_ids for b in blocks])  # every block full: no pads
            values = torch.stack([b.values for b in blocks])
        else:
            token_ids = torch.stack([padded(b, "token_ids", torch.int64) for b in blocks])
            values = torch.stack([padded(b, "values", torch.float32) for b in blocks])
        return DraftProbsBatch(token_ids=token_ids.to(device), values=values.to(device))


def verify_blocks(
    draft_token_ids: torch.Tensor,  # [batch, k] int64
    num_draft_tokens: torch.Tensor,  # [batch] int64, draft tokens valid per row (<= k)
    draft_probs: Sequence[DraftProbs],  # request b: its block's q, [num_draft_b, ...]
    target_probs: Sequence[torch.Tensor],  # request b: [num_draft_b + 1, vocab]
    uniforms: VerifyUniforms,
    *,
    validate: bool = True,
    workspace: Workspace | None = None,
) -> BatchVerifyResult:
    """The stochastic rule for one round's blocks, q dense or sparse (see module docstring).

    All tensors on the device of ``target_probs``. ``validate=False`` trusts its inputs (blocks
    checked at the draft -> target boundary, ``specray.rpc.messages.check_block``): only shapes
    are checked then, which costs no host synchronisation. A batch mixing dense and sparse
    blocks runs the rule once per form. ``workspace``: the caller's, reused from round to
    round (None: a fresh one). The target rows are read fastest as consecutive rows of one
    tensor, as the batched logits pipeline returns them.
    """
    batch, k = draft_token_ids.shape
    _check_shapes(draft_token_ids, num_draft_tokens, draft_probs, target_probs, uniforms)
    workspace = Workspace() if workspace is None else workspace
    device = draft_token_ids.device
    forms = [isinstance(block, SparseDraftProbs) for block in draft_probs]
    nonempty = [form for form, block in zip(forms, draft_probs, strict=True) if _rows(block)]
    if len(set(nonempty)) < 2:  # one form (empty blocks fit either)
        draft = DraftProbsBatch.from_blocks(draft_probs, k, device)
        if validate:
            _check_values(draft_token_ids, num_draft_tokens, draft, target_probs)
        num_accepted, final_token = _rules(
            draft_token_ids, num_draft_tokens, draft, target_probs, uniforms, workspace
        )
        return _assemble(draft_token_ids, num_accepted, final_token)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    final_token = torch.zeros(batch, dtype=torch.int64, device=device)
    for sparse in (False, True):
        slots = [b for b, form in enumerate(forms) if form == sparse]
        index = torch.tensor(slots, dtype=torch.int64, device=device)
        part = VerifyUniforms(
            uniforms.accept[index], uniforms.residual[index], uniforms.bonus[index]
        )
        draft = DraftProbsBatch.from_blocks([draft_probs[b] for b in slots], k, device)
        targets = [target_probs[b] for b in slots]
        if validate:
            _check_values(draft_token_ids[index], num_draft_tokens[index], draft, targets)
        num_accepted[index], final_token[index] = _rules(
            draft_token_ids[index], num_draft_tokens[index], draft, targets, part, workspace
        )
    return _assemble(draft_token_ids, num_accepted, final_token)


def _rows(block: DraftProbs) -> int:
    return block.num_rows if isinstance(block, SparseDraftProbs) else block.shape[0]


def _rules(
    draft_token_ids,
    num_draft_tokens,
    draft: DraftProbsBatch,
    target_probs,
    uniforms,
    workspace: Workspace,
):
    """One form's rule: ``(num_accepted [batch], final_token [batch])`` on the device."""
    batch, k = draft_token_ids.shape
    target = _TargetRows(target_probs, num_draft_tokens)
    vocab = target_probs[0].shape[-1]
    safe_ids = draft_token_ids.clamp(0, vocab - 1)  # [batch, k], padding is never read
    target_at_draft = target.at_draft(safe_ids).to(torch.float64)  # [batch, k], p(d) as given
    draft_sums, draft_at_draft = _draft_at_draft(draft, safe_ids, k)  # [batch, k] each
    draft_at_draft = draft_at_draft / draft_sums.clamp(min=_TINY)  # q(d) normalised
    accept_probs = torch.clamp(target_at_draft / draft_at_draft.clamp(min=_TINY), max=1.0)
    accepted = uniforms.accept < accept_probs  # [batch, k]
    num_accepted = _first_rejection(accepted, num_draft_tokens)  # [batch]

    # Each request's final row, p at position num_accepted: a float32 copy the residual may
    # change in place.
    out = workspace.rows("final", batch, vocab, torch.float32, num_accepted.device)
    final = target.final(num_accepted, out)  # [batch, vocab]
    final_uniform = uniforms.bonus  # [batch]
    if k == 0:
        return num_accepted, sample_blocked(final, final_uniform)
    # Rejected rows sample the residual max(0, p - q) at the first rejected position.
    rejected = num_accepted < num_draft_tokens  # [batch]
    # [batch]: the rejected position where rejected, else a row inside the block
    at = torch.minimum(num_accepted, (num_draft_tokens - 1).clamp(min=0))
    residual_uniform = uniforms.residual.gather(1, at[:, None])[:, 0]  # [batch]
    final_uniform = torch.where(rejected, residual_uniform, final_uniform)
    at_sums = draft_sums.gather(1, at[:, None]).clamp(min=_TINY)  # [batch, 1]
    if draft.sparse:
        masses = _sparse_residual(final, draft, at, at_sums, rejected)
    else:
        masses = _dense_residual(final, draft, at, at_sums, rejected)
    return num_accepted, sample_blocked(final, final_uniform, masses)


class _TargetRows:
    """The requests' p rows (request b: ``num_draft_tokens[b] + 1`` rows), read through one
    ``[rows, vocab]`` view when they are consecutive rows of one tensor (the pipeline's
    output), else request by request (no copy of them all)."""

    def __init__(self, target_probs: Sequence[torch.Tensor], num_draft_tokens: torch.Tensor):
        self.parts = target_probs
        self.flat = consecutive_rows(target_probs)  # [rows, vocab] or None
        sizes = num_draft_tokens + 1  # [batch]
        self.starts = sizes.cumsum(dim=0) - sizes  # [batch], each request's first row

    def at_draft(self, safe_ids: torch.Tensor) -> torch.Tensor:
        """p at each drafted id, ``[batch, k]`` (positions past a block are never read)."""
        k = safe_ids.shape[1]
        if self.flat is not None:
            positions = self.starts[:, None] + torch.arange(k, device=safe_ids.device)
            return self.flat[positions.clamp(max=self.flat.shape[0] - 1), safe_ids]
        values = torch.zeros(safe_ids.shape, dtype=self.parts[0].dtype, device=safe_ids.device)
        for b, rows in enumerate(self.parts):
            n = rows.shape[0] - 1
            values[b, :n] = rows[:n].gather(-1, safe_ids[b, :n, None])[:, 0]
        return values

    def final(self, num_accepted: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """A float32 copy of each request's row at ``num_accepted`` into ``out``,
        ``[batch, vocab]``."""
        if self.flat is not None and self.flat.dtype == out.dtype:
            return torch.index_select(self.flat, 0, self.starts + num_accepted, out=out)
        for b, part in enumerate(self.parts):
            out[b] = part.index_select(0, num_accepted[b : b + 1])[0]
        return out


def _draft_at_draft(draft: DraftProbsBatch, safe_ids, k: int):
    """Each q row's float64 sum and its value at the drafted id, ``[batch, k]`` each (1 and 0
    past a block)."""
    if draft.sparse:
        values = draft.values.double()  # [batch, k, M]
        matches = draft.token_ids == safe_ids[..., None]  # [batch, k, M], one at most
        # An all-padding row sums to 0; the match sum is exact: one term.
        return values.sum(dim=-1), (values * matches).sum(dim=-1)
    batch = safe_ids.shape[0]
    float64 = {"dtype": torch.float64, "device": safe_ids.device}
    draft_sums = torch.ones(batch, k, **float64)
    draft_at_draft = torch.zeros(batch, k, **float64)
    vocab = draft.dense_rows[0].shape[-1] if draft.dense_rows else 0
    scratch = torch.empty(k, vocab, **float64)  # one request's q rows, widened
    for b, rows in enumerate(draft.dense_rows):
        n = rows.shape[0]
        if n:
            widened = scratch[:n].copy_(rows)  # [n, vocab]
            draft_sums[b, :n] = widened.sum(dim=-1)
            draft_at_draft[b, :n] = widened.gather(-1, safe_ids[b, :n, None])[:, 0]
    return draft_sums, draft_at_draft


def _sparse_residual(final, draft: DraftProbsBatch, at, at_sums, rejected) -> torch.Tensor:
    """Writes each rejected row's residual into ``final`` [batch, vocab] in place (unless
    degenerate) and returns the rows' block masses ``[batch, num_blocks]``. q is subtracted
    at its M ids only; every other id keeps p."""
    batch = final.shape[0]
    rows = torch.arange(batch, device=final.device)
    token_ids = draft.token_ids[rows, at]  # [batch, M]
    draft_at = draft.values[rows, at].double() / at_sums * rejected[:, None]  # [batch, M]
    target_at = final.gather(-1, token_ids)  # [batch, M] float32, p
    # max(0, p - q) in float64, stored as float32 (rows that keep p store p itself). Padding
    # entries (id 0, q 0) store p(0); amin keeps the real entry's residual for id 0.
    residual_at = (target_at.double() - draft_at).clamp(min=0.0).float()  # [batch, M]
    final.scatter_reduce_(-1, token_ids, residual_at, "amin", include_self=False)
    masses = block_masses(final)  # [batch, num_blocks], the residual's where rejected
    # p == q up to rounding: no residual to speak of, so sample from p (put it back).
    restore = rejected & (masses.sum(dim=-1) <= DEGENERATE_RESIDUAL_MASS)  # [batch]
    put_back = torch.where(restore[:, None], target_at, residual_at)  # [batch, M]
    final.scatter_reduce_(-1, token_ids, put_back, "amin", include_self=False)
    # Masses follow without a second read: each restored entry adds p - residual >= 0.
    # Padding entries add p(0) - p(0) = 0.
    added = (target_at.double() - residual_at.double()) * restore[:, None]  # [batch, M]
    return masses.scatter_add(1, torch.div(token_ids, BLOCK, rounding_mode="floor"), added)


def _dense_residual(final, draft: DraftProbsBatch, at, at_sums, rejected) -> torch.Tensor:
    """As :func:`_sparse_residual`, for dense q: one q row per request, at ``at``; returns
    the block masses."""
    residual = torch.zeros(final.shape, dtype=torch.float64, device=final.device)
    for b, rows in enumerate(draft.dense_rows):
        if rows.shape[0]:  # an empty block is never rejected: its row stays 0
            row = rows.index_select(0, at[b : b + 1])  # [1, vocab]
            torch.div(row, at_sums[b : b + 1], out=residual[b : b + 1])
    residual.mul_(rejected[:, None])  # rows that keep p subtract 0
    torch.sub(final, residual, out=residual).clamp_(min=0.0)  # max(0, p - q)
    use_residual = rejected & ~(residual.sum(dim=-1) <= DEGENERATE_RESIDUAL_MASS)
    torch.where(use_residual[:, None], residual.float(), final, out=final)
    return block_masses(final)


def _check_shapes(draft_token_ids, num_draft_tokens, draft_probs, target_probs, uniforms):
    """Shapes and block lengths: host metadata only, no synchronisation."""
    batch, k = draft_token_ids.shape
    if k > MAX_SPEC_LEN:
        raise ValueError(f"k must be <= MAX_SPEC_LEN={MAX_SPEC_LEN}, got {k}")
    if batch == 0 or len(draft_probs) != batch or len(target_probs) != batch:
        raise ValueError(
            f"need one block and one target row set per request, batch {batch}, got "
            f"{len(draft_probs)} blocks and {len(target_probs)} target row sets"
        )
    if tuple(num_draft_tokens.shape) != (batch,):
        raise ValueError(f"num_draft_tokens must have shape {(batch,)}")
    vocab = target_probs[0].shape[-1]
    for b, (block, rows) in enumerate(zip(draft_probs, target_probs, strict=True)):
        n = _rows(block)
        if rows.dim() != 2 or tuple(rows.shape) != (n + 1, vocab) or n > k:
            raise ValueError(
                f"request {b}: target_probs must be [num_draft + 1, {vocab}] with num_draft "
                f"<= {k}; its block has {n} rows, its target rows {tuple(rows.shape)}"
            )
        block_vocab = block.vocab_size if isinstance(block, SparseDraftProbs) else block.shape[-1]
        if block_vocab != vocab:
            raise ValueError(f"request {b}: draft_probs vocabulary {block_vocab}, not {vocab}")
    for name, expected in (("accept", (batch, k)), ("residual", (batch, k)), ("bonus", (batch,))):
        if tuple(getattr(uniforms, name).shape) != expected:
            raise ValueError(
                f"uniforms.{name} must have shape {expected}, "
                f"got {tuple(getattr(uniforms, name).shape)}"
            )


def _check_values(draft_token_ids, num_draft_tokens, draft: DraftProbsBatch, target_probs):
    """Block lengths match num_draft_tokens, drafted ids are in range and q(d) > 0: one
    combined host check."""
    batch, k = draft_token_ids.shape
    device = draft_token_ids.device
    vocab = target_probs[0].shape[-1]
    lengths = torch.tensor([rows.shape[0] - 1 for rows in target_probs], device=device)
    valid = torch.arange(k, device=device)[None, :] < lengths[:, None]  # [batch, k]
    out_of_range = (draft_token_ids < 0) | (draft_token_ids >= vocab)
    if draft.sparse:
        matches = draft.token_ids == draft_token_ids[..., None]  # [batch, k, M]
        draft_at_draft = (draft.values * matches).sum(dim=-1)  # [batch, k]
    else:
        draft_at_draft = torch.ones(batch, k, device=device)
        for b, rows in enumerate(draft.dense_rows):
            ids = draft_token_ids[b, : rows.shape[0], None].clamp(0, vocab - 1)
            draft_at_draft[b, : rows.shape[0]] = rows.gather(-1, ids)[:, 0]
    bad = torch.stack(
        [
            (lengths != num_draft_tokens).any(),
            (out_of_range & valid).any(),
            ((draft_at_draft <= 0) & valid).any(),
        ]
    )
    flags = bad.tolist()  # the one host check
    if flags[0]:
        raise ValueError(f"num_draft_tokens must match the blocks' lengths {lengths.tolist()}")
    if flags[1]:
        raise ValueError(f"draft_token_ids must be in [0, {vocab}), got {draft_token_ids.tolist()}")
    if flags[2]:
        raise ValueError("draft_probs must be positive at every drafted token (q(d) > 0)")
