"""The logits pipeline for every request of a forward in one pass (docs/design.md 1.1).

:class:`~specray.sampling.pipeline.LogitsPipeline` is the reference: one request at a time,
about a dozen kernels each. :class:`BatchLogitsPipeline` runs the same steps, in the same
order, once over the flat logits ``[R, vocab]`` of a round (request i owns ``n_i + 1``
consecutive rows) and gives bit-identical results: each step is the reference's elementwise
arithmetic with per-row parameters (``[rows, 1]`` tensors) in place of Python numbers, and
every reduction (argmax, softmax, top-k, sort, cumsum) runs along one row, as in the reference.
What that takes:
  - divisions by a tensor on both sides (CUDA divides by a Python number as a multiplication
    by its reciprocal, which is not always the same float);
  - top-k with different k per row: one ``torch.topk`` with the largest k, then each row's
    k-th value (the same number whichever k was asked for);
  - top-p: the reference's full sort of each row (sorting only the top-k survivors would sum
    the softmax in another order, and ties at the k-th value can keep more than k);
  - the bias / mask term added to every entry of a row that has one, as the reference does
    (``-0.0 + 0.0`` is ``0.0``; a sparse add would keep ``-0.0``, and a GPU's radix sort
    orders the two zeros);
  - on a CPU, requests whose only step after temperature is top-k: the reference's
    :func:`~specray.sampling.top_k.top_k_probs` once per k, over the rows of that k (a softmax
    over each row's top candidates, no pass over the rows per step).

What a request set needs is worked out on the host, where the parameters are known, into one
:class:`SamplingMetadata` per forward (vLLM's "sampling metadata"): per-row parameter tensors,
sparse index lists for the static parts (logit bias, allowed / banned ids, prompt tokens) and
for the output history, and the rows each step touches. A step no request uses is skipped: no
kernel and no host sync to find that out. The pass itself never reads a tensor on the host.

Worked example: requests A (greedy, 2 rows) and B (temperature 0.5, top_k 2, 1 row) over the
flat logits ``[[1, 3, 2], [0, 0, 5], [4, 1, 2]]`` -> A: argmax ids ``[1, 2]``; B: rows
``[8, 2, 4]`` after temperature, ``[8, -inf, 4]`` after top-k, softmax
``[[0.982, 0, 0.018]]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import groupby

import torch

from specray.sampling.argmax import row_argmax
from specray.sampling.grammar import unpack_masks
from specray.sampling.pipeline import NEG_INF, LogitsPipeline
from specray.sampling.rows import Workspace, consecutive_rows, rows_in_place
from specray.sampling.staging import RowIndex, Staging
from specray.sampling.top_k import TopK, TopKGroup, takes_candidates, top_k_probs, top_values


@dataclass(frozen=True)
class RowValues:
    """A per-row parameter of one step."""

    rows: torch.Tensor | None  # [n] int64, the rows the step runs on; None: every row
    values: torch.Tensor  # [n, 1] float32


@dataclass(frozen=True)
class Additive:
    """Step 1, logit bias and masks: per term a fill value with sparse exceptions
    (:func:`specray.sampling.pipeline.additive_entries`; a request with min_tokens has a second
    term, with its stop ids at -inf, for its rows before min_tokens); the dense terms are
    built on the device for the rows that have one only."""

    rows: torch.Tensor | None  # [Ra] int64 rows of the round; None: every row
    row_slot: torch.Tensor  # [Ra] int64, each row's term among these
    fill: torch.Tensor  # [Na, 1] float32, 0 or -inf
    entry_slot: torch.Tensor  # [E] int64
    entry_ids: torch.Tensor  # [E] int64
    entry_values: torch.Tensor  # [E] float32


@dataclass(frozen=True)
class GrammarMasks:
    """Step 0 for the requests with a grammar: each row's allowed tokens, packed."""

    rows: torch.Tensor | None  # [Rg] int64 rows of the round; None: every row
    packed: torch.Tensor  # [Rg, ceil(vocab / 32)] int32 (specray.sampling.grammar)


@dataclass(frozen=True)
class Penalties:
    """Step 2 for the requests with a penalty; a neutral value (repetition 1, presence or
    frequency 0) leaves a row exactly as it is."""

    rows: torch.Tensor | None  # [Rp] int64 rows of the round; None: every row
    row_slot: torch.Tensor  # [Rp] int64, each row's request among these (Np of them)
    num_requests: int  # Np
    history_slot: torch.Tensor  # [H] int64, committed output tokens: whose ...
    history_ids: torch.Tensor  # [H] int64 ... and which
    # (row, token) pairs: a request's candidate t counts in its rows t + 1, t + 2, ...
    candidate_row: torch.Tensor  # [C] int64, among these rows
    candidate_ids: torch.Tensor  # [C] int64
    prompt_slot: torch.Tensor | None  # [P] int64, prompt tokens (repetition penalty only)
    prompt_ids: torch.Tensor | None  # [P] int64
    repetition: torch.Tensor | None  # [Rp, 1] float32; None: 1 on every row
    frequency: torch.Tensor | None  # [Rp, 1] float32; None: 0 on every row
    presence: torch.Tensor | None  # [Rp, 1] float32; None: 0 on every row


@dataclass(frozen=True)
class SamplingMetadata:
    """One forward's request set, on the logits' device. Steps 1-2 index rows of the round
    (``[R, vocab]``). Steps 4-8 of the sampled requests in a top-k group run per group; those
    of the others (the dense path) index the dense rows (``[Rd, vocab]``, the round's rows of
    those requests, in order). A step that is None runs no kernel."""

    vocab_size: int
    num_rows: tuple[int, ...]  # rows of each request (n_i + 1), in order
    greedy: tuple[bool, ...]  # per request
    # None: every row (or, for a kind of request the set lacks, unused)
    greedy_rows: torch.Tensor | None  # [Rg] int64 rows of greedy requests
    dense_rows: torch.Tensor | None  # [Rd] int64 rows of the dense path's requests
    # (first dense row, first row among the sampled requests' rows, rows) per run
    dense_runs: tuple[tuple[int, int, int], ...]
    grammar: GrammarMasks | None
    additive: Additive | None
    penalties: Penalties | None
    temperature: torch.Tensor | None  # [Rd, 1] float32; None: 1 on every dense row
    min_p: RowValues | None
    top_k: TopK | None
    top_p: RowValues | None
    top_k_groups: tuple[TopKGroup, ...]  # on a CPU only

    @staticmethod
    def build(
        pipelines: Sequence[LogitsPipeline],
        num_rows: Sequence[int],
        output_token_ids: Sequence[Sequence[int]],
        candidate_token_ids: Sequence[Sequence[int]],
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Row j of request i sees the history ``output_token_ids[i]`` plus
        ``candidate_token_ids[i][:j]`` (and its prompt), as in :class:`LogitsPipeline`."""
        _check(pipelines, num_rows, output_token_ids, candidate_token_ids)
        device = torch.device(device)
        staged = Staging()
        rows = RowIndex(staged, num_rows)
        greedy = tuple(pipeline.params.greedy for pipeline in pipelines)
        picked = [i for i, is_greedy in enumerate(greedy) if is_greedy]
        sampled = [i for i, is_greedy in enumerate(greedy) if not is_greedy]
        vocab_size = pipelines[0].vocab_size if pipelines else 0
        grouped = {i for i in sampled if takes_candidates(pipelines[i].params, vocab_size, device)}
        dense = [i for i in sampled if i not in grouped]
        metadata = SamplingMetadata(
            vocab_size=vocab_size,
            num_rows=tuple(num_rows),
            greedy=greedy,
            greedy_rows=rows.of(picked) if picked else None,
            dense_rows=rows.of(dense) if dense else None,
            dense_runs=_runs(rows.indices(dense, sampled)[0]),
            grammar=_stage_grammar(rows, pipelines, output_token_ids, candidate_token_ids, device),
            additive=_stage_additive(rows, pipelines, output_token_ids),
            penalties=_stage_penalties(rows, pipelines, output_token_ids, candidate_token_ids),
            **_stage_sampled_steps(rows, pipelines, dense, vocab_size),
            top_k_groups=_stage_top_k_groups(rows, pipelines, sampled, grouped),
        )
        return Staging.resolve(metadata, staged.upload(device))


class BatchLogitsPipeline:
    """Runs :class:`SamplingMetadata` over a forward's logits; holds a workspace reused from
    forward to forward (on a CPU a fresh ``[80, 128256]`` float32 buffer costs ~18 ms of page
    faults, most of a softmax's time there). The probabilities it returns are views of that
    workspace, valid until its next call."""

    def __init__(self) -> None:
        self._workspace = Workspace()

    def __call__(
        self,
        pipelines: Sequence[LogitsPipeline],
        logits: Sequence[torch.Tensor],
        output_token_ids: Sequence[Sequence[int]],
        candidate_token_ids: Sequence[Sequence[int]],
    ) -> list[torch.Tensor]:
        """Per request, from its logits ``[n_i + 1, vocab]``: int64 argmax ids ``[n_i + 1]``
        when greedy, else float32 probabilities ``[n_i + 1, vocab]`` (views of this pass's
        workspace: valid until its next call); what :meth:`LogitsPipeline.greedy_token_ids` /
        :meth:`LogitsPipeline.probs` give."""
        if not logits:
            return []
        if len(pipelines) == len(logits) and raw_greedy(pipelines):
            return _raw_argmax(logits, candidate_token_ids)
        metadata = SamplingMetadata.build(
            pipelines,
            [part.shape[0] for part in logits],
            output_token_ids,
            candidate_token_ids,
            logits[0].device,
        )
        return self.run(metadata, logits)

    def run(
        self, metadata: SamplingMetadata, logits: torch.Tensor | Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """``logits``: the flat ``[R, vocab]``, or one ``[n_i + 1, vocab]`` per request (read
        in place when they are consecutive rows of one tensor, as ModelRunner.forward gives
        them; copied into the workspace otherwise)."""
        parts = [logits] if isinstance(logits, torch.Tensor) else list(logits)
        total, vocab_size = sum(metadata.num_rows), metadata.vocab_size
        rows = sum(part.shape[0] for part in parts)
        if rows != total or parts[0].shape[-1] != vocab_size:
            raise ValueError(
                f"the logits have {rows} rows of {parts[0].shape[-1]}, the metadata {total} "
                f"of {vocab_size}"
            )
        out = consecutive_rows(parts)  # [R, vocab], only read
        owned = out is None or out.dtype != torch.float32  # out is the workspace, ours to change
        if owned:
            out = self._workspace.rows("logits", total, vocab_size, torch.float32, parts[0].device)
            torch.cat(parts, out=out)
        if (metadata.grammar, metadata.additive, metadata.penalties) != (None, None, None):
            out, owned = out if owned else self._copy(out), True
            if metadata.grammar is not None:
                _apply_grammar(out, metadata.grammar)
            if metadata.additive is not None:
                _add_additive(out, metadata.additive)
            if metadata.penalties is not None:
                _apply_penalties(out, metadata.penalties)
        greedy_ids = sampled_probs = iter(())
        if any(metadata.greedy):
            picked = _select(out, metadata.greedy_rows)
            sizes = [n for n, g in zip(metadata.num_rows, metadata.greedy, strict=True) if g]
            greedy_ids = iter(row_argmax(picked).split(sizes))  # [Rg] int64
        if not all(metadata.greedy):
            sizes = [n for n, g in zip(metadata.num_rows, metadata.greedy, strict=True) if not g]
            probs = self._sampled_probs(out, owned, metadata, sum(sizes))  # [Rs, vocab]
            sampled_probs = iter(probs.split(sizes))
        return [next(greedy_ids) if greedy else next(sampled_probs) for greedy in metadata.greedy]

    def _sampled_probs(
        self, out: torch.Tensor, owned: bool, metadata: SamplingMetadata, num_sampled: int
    ) -> torch.Tensor:
        """Steps 4-8 on the sampled requests' rows: ``[Rs, vocab]`` probabilities. ``out`` may
        be changed only when ``owned``."""
        # Into the workspace: a fresh [R, vocab] output of every forward cost more in page
        # faults than the softmax itself on a CPU (docs/bench/history.md).
        probs = self._workspace.rows("probs", num_sampled, out.shape[1], torch.float32, out.device)
        if metadata.top_k_groups:
            probs.zero_()  # the groups write their rows' candidates only
        for group in metadata.top_k_groups:  # before the dense path, which may change out
            logits = out if group.rows is None else self._rows(out, group.rows)  # [n, vocab]
            top_k_probs(logits, group.temperature, group.top_k).write(probs, group.slots)
        if metadata.dense_runs:
            logits = self._dense_logits(out, owned, metadata)  # [Rd, vocab]
            for dense_row, row, n in metadata.dense_runs:
                torch.softmax(logits[dense_row : dense_row + n], dim=-1, out=probs[row : row + n])
        return probs

    def _dense_logits(
        self, out: torch.Tensor, owned: bool, metadata: SamplingMetadata
    ) -> torch.Tensor:
        """Steps 4-7 on the dense path's rows: ``[Rd, vocab]`` (a copy, the workspace, or
        ``out`` itself when no step changes it or it is ``owned``)."""
        changes = (metadata.min_p, metadata.top_k, metadata.top_p) != (None, None, None)
        temperature = metadata.temperature
        if metadata.dense_rows is not None:
            logits = out.index_select(0, metadata.dense_rows)  # [Rd, vocab], a copy
            if temperature is not None:
                logits.div_(temperature)
        elif temperature is not None:  # the copy into the workspace divides on the way
            target = (
                out if owned else self._workspace.rows("logits", *out.shape, out.dtype, out.device)
            )
            logits = torch.div(out, temperature, out=target)
        else:
            logits = self._copy(out) if changes and not owned else out
        if metadata.min_p is not None:
            _on_rows(logits, metadata.min_p.rows, _min_p_step(metadata.min_p.values))
        if metadata.top_k is not None:
            _on_rows(logits, metadata.top_k.rows, self._top_k_step(metadata.top_k))
        if metadata.top_p is not None:
            _on_rows(logits, metadata.top_p.rows, _top_p_step(metadata.top_p.values))
        return logits

    def _rows(self, out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """A copy of ``out[rows]`` in the workspace."""
        target = self._workspace.rows("rows", len(rows), out.shape[1], out.dtype, out.device)
        return torch.index_select(out, 0, rows, out=target)

    def _copy(self, logits: torch.Tensor) -> torch.Tensor:
        return self._workspace.rows("logits", *logits.shape, torch.float32, logits.device).copy_(
            logits
        )

    def _top_k_step(self, top_k: TopK) -> Callable[[torch.Tensor], None]:
        def step(logits: torch.Tensor) -> None:  # [n, vocab]
            # The k-th largest value of each row is the same number whichever k topk was
            # asked for, so one topk with the largest k serves every row.
            top = top_values(logits, top_k.largest_k)  # [n, largest_k]
            kth = top[:, -1:] if top_k.kth_index is None else top.gather(1, top_k.kth_index)
            below = self._workspace.rows("mask", *logits.shape, torch.bool, logits.device)
            torch.lt(logits, kth, out=below)  # ties at the k-th value are kept
            _fill_neg_inf(logits, below)

        return step


def _fill_neg_inf(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """``logits.masked_fill_(mask, -inf)``, as one ``where`` (faster on a CPU)."""
    torch.where(mask, torch.full((), NEG_INF, device=logits.device), logits, out=logits)


def _select(tensor: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return tensor if rows is None else tensor.index_select(0, rows)


def _on_rows(
    tensor: torch.Tensor, rows: torch.Tensor | None, step: Callable[[torch.Tensor], None]
) -> None:
    """Apply an in-place ``step`` to ``rows`` of ``tensor`` (every row when None)."""
    if rows is None:
        step(tensor)
        return
    part = tensor.index_select(0, rows)
    step(part)
    tensor.index_copy_(0, rows, part)


def _apply_grammar(out: torch.Tensor, grammar: GrammarMasks) -> None:
    def step(logits: torch.Tensor) -> None:  # [Rg, vocab]
        allowed = unpack_masks(grammar.packed, logits.shape[1])  # [Rg, vocab]
        logits.masked_fill_(~allowed, NEG_INF)

    _on_rows(out, grammar.rows, step)


def _add_additive(out: torch.Tensor, additive: Additive) -> None:
    vocab_size = out.shape[1]
    term = additive.fill.expand(-1, vocab_size).contiguous()  # [Na, vocab]
    term.index_put_((additive.entry_slot, additive.entry_ids), additive.entry_values)

    def step(logits: torch.Tensor) -> None:  # [Ra, vocab]
        logits.add_(term.index_select(0, additive.row_slot))

    _on_rows(out, additive.rows, step)


def _apply_penalties(out: torch.Tensor, penalties: Penalties) -> None:
    vocab_size, device = out.shape[1], out.device
    one = torch.ones((), device=device)
    # Occurrences in each row's output history: the request's committed output, then the
    # candidates before the row. Small integers, exact in float32 in any order of adding.
    counts = torch.zeros(penalties.num_requests, vocab_size, device=device)  # [Np, vocab]
    counts.index_put_((penalties.history_slot, penalties.history_ids), one, accumulate=True)
    counts = counts.index_select(0, penalties.row_slot)  # [Rp, vocab]
    counts.index_put_((penalties.candidate_row, penalties.candidate_ids), one, accumulate=True)

    def step(logits: torch.Tensor) -> None:  # [Rp, vocab]
        if penalties.repetition is not None:
            in_prompt = torch.zeros(
                penalties.num_requests, vocab_size, dtype=torch.bool, device=device
            )
            present = torch.ones((), dtype=torch.bool, device=device)
            in_prompt.index_put_((penalties.prompt_slot, penalties.prompt_ids), present)
            seen = (counts > 0) | in_prompt.index_select(0, penalties.row_slot)
            penalty = penalties.repetition
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits.copy_(torch.where(seen, penalised, logits))
        if penalties.frequency is not None:
            logits.sub_(penalties.frequency * counts)
        if penalties.presence is not None:
            logits.sub_(penalties.presence * (counts > 0).to(torch.float32))

    _on_rows(out, penalties.rows, step)


def _min_p_step(min_p: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def step(logits: torch.Tensor) -> None:  # [n, vocab]
        probs = torch.softmax(logits, dim=-1)
        threshold = min_p * probs.max(dim=-1, keepdim=True).values  # [n, 1]
        _fill_neg_inf(logits, probs < threshold)

    return step


def _top_p_step(top_p: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def step(logits: torch.Tensor) -> None:  # [n, vocab]
        # The reference's full sort, row by row: softmax and cumsum over the whole sorted row
        # (sorting only the top-k survivors would sum in another order, and ties at the k-th
        # value can keep more than k).
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [n, vocab]
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [n, vocab]
        drop_sorted = mass_before >= top_p
        drop_sorted[:, 0] = False  # the top token always stays (see LogitsPipeline.probs)
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        _fill_neg_inf(logits, drop)

    return step


def _check(pipelines, num_rows, output_token_ids, candidate_token_ids) -> None:
    counts = {len(pipelines), len(num_rows), len(output_token_ids), len(candidate_token_ids)}
    if len(counts) != 1:
        raise ValueError(
            f"one entry per request in each of pipelines, num_rows, output_token_ids and "
            f"candidate_token_ids, got {len(pipelines)}, {len(num_rows)}, "
            f"{len(output_token_ids)} and {len(candidate_token_ids)}"
        )
    vocab_sizes = {pipeline.vocab_size for pipeline in pipelines}
    if len(vocab_sizes) > 1:
        raise ValueError(f"the requests' pipelines have vocabularies {sorted(vocab_sizes)}")
    for rows, candidates, output, pipeline in zip(
        num_rows, candidate_token_ids, output_token_ids, pipelines, strict=True
    ):
        _check_rows(rows, candidates)
        for name, ids in (("candidate_token_ids", candidates), ("output_token_ids", output)):
            if ids and (min(ids) < 0 or max(ids) >= pipeline.vocab_size):
                raise ValueError(
                    f"{name} holds an id outside the vocabulary [0, {pipeline.vocab_size})"
                )


def _stage_grammar(rows: RowIndex, pipelines, output_token_ids, candidate_token_ids, device):
    """Each grammar request's masks, from its matcher on the host, in one copy."""
    requests = [i for i, pipeline in enumerate(pipelines) if pipeline.grammar is not None]
    if not requests:
        return None
    packed = torch.cat(
        [
            pipelines[i].grammar.masks(
                output_token_ids[i], candidate_token_ids[i], rows.num_rows[i]
            )
            for i in requests
        ]
    )  # [Rg, words] int32, on the host
    return GrammarMasks(rows=rows.of(requests), packed=packed.to(device, non_blocking=True))


def _stage_additive(rows: RowIndex, pipelines, output_token_ids) -> Additive | None:
    """The step-1 terms and which row takes which: a request's rows before min_tokens take
    its early term (:attr:`LogitsPipeline.early_additive`), the others its additive one."""
    terms, row_ids, row_slot = [], [], []
    for i, pipeline in enumerate(pipelines):
        num_rows = rows.num_rows[i]
        early = pipeline.rows_before_min_tokens(len(output_token_ids[i]), num_rows)
        for term, first, last in (
            (pipeline.early_additive, 0, early),
            (pipeline.additive, early, num_rows),
        ):
            if term is not None and last > first:
                row_ids += range(rows.starts[i] + first, rows.starts[i] + last)
                row_slot += [len(terms)] * (last - first)
                terms.append(term)
    if not terms:
        return None
    staged = rows.staged
    entry_slot = [slot for slot, (_, entries) in enumerate(terms) for _ in entries]
    return Additive(
        rows=None if len(row_ids) == sum(rows.num_rows) else staged.ints(row_ids),
        row_slot=staged.ints(row_slot),
        fill=staged.floats([fill for fill, _ in terms]),
        entry_slot=staged.ints(entry_slot),
        entry_ids=staged.ints([t for _, entries in terms for t in entries]),
        entry_values=staged.floats(
            [value for _, entries in terms for value in entries.values()], column=False
        ),
    )


def _stage_penalties(rows: RowIndex, pipelines, output_token_ids, candidate_token_ids):
    requests = [i for i, pipeline in enumerate(pipelines) if pipeline.uses_output_history]
    if not requests:
        return None
    staged, slot_of = rows.staged, {i: slot for slot, i in enumerate(requests)}
    history_slot, history_ids, candidate_row, candidate_ids = [], [], [], []
    prompt_slot, prompt_ids = [], []
    first_row = 0  # the request's first row among the penalised rows
    for slot, i in enumerate(requests):
        history_slot += [slot] * len(output_token_ids[i])
        history_ids += output_token_ids[i]
        for row in range(rows.num_rows[i]):  # row j counts candidates[:j]
            candidate_row += [first_row + row] * row
            candidate_ids += candidate_token_ids[i][:row]
        first_row += rows.num_rows[i]
        if pipelines[i].params.repetition_penalty != 1.0:
            prompt_slot += [slot] * len(pipelines[i].prompt_token_set)
            prompt_ids += pipelines[i].prompt_token_set
    values = {}
    for name, neutral in (
        ("repetition_penalty", 1.0),
        ("frequency_penalty", 0.0),
        ("presence_penalty", 0.0),
    ):
        # + 0.0 makes a -0.0 penalty 0.0, which the reference skips (x - -0.0 turns -0.0 to 0.0)
        per_row = rows.per_row(requests, lambda i, name=name: getattr(pipelines[i].params, name))
        per_row = [value + 0.0 for value in per_row]
        values[name] = None if all(v == neutral for v in per_row) else staged.floats(per_row)
    repeats = values["repetition_penalty"] is not None
    return Penalties(
        rows=rows.of(requests),
        row_slot=staged.ints(rows.per_row(requests, slot_of.get)),
        num_requests=len(requests),
        history_slot=staged.ints(history_slot),
        history_ids=staged.ints(history_ids),
        candidate_row=staged.ints(candidate_row),
        candidate_ids=staged.ints(candidate_ids),
        prompt_slot=staged.ints(prompt_slot) if repeats else None,
        prompt_ids=staged.ints(prompt_ids) if repeats else None,
        repetition=values["repetition_penalty"],
        frequency=values["frequency_penalty"],
        presence=values["presence_penalty"],
    )


def _stage_sampled_steps(rows: RowIndex, pipelines, sampled: list[int], vocab_size: int) -> dict:
    """Steps 4-7, over the sampled requests' rows."""
    staged = rows.staged

    def param(name: str) -> Callable[[int], float]:
        return lambda i: getattr(pipelines[i].params, name)

    steps: dict[str, object] = dict.fromkeys(("temperature", "min_p", "top_k", "top_p"))
    if any(param("temperature")(i) != 1.0 for i in sampled):
        steps["temperature"] = staged.floats(rows.per_row(sampled, param("temperature")))
    for name, used in (("min_p", lambda v: v > 0.0), ("top_p", lambda v: v < 1.0)):
        requests = [i for i in sampled if used(param(name)(i))]
        if requests:
            values = staged.floats(rows.per_row(requests, param(name)))
            steps[name] = RowValues(rows.of(requests, sampled), values)
    requests = [i for i in sampled if 0 < param("top_k")(i) < vocab_size]
    if requests:
        ks = rows.per_row(requests, param("top_k"))
        kth_index = None if len(set(ks)) == 1 else staged.ints([k - 1 for k in ks], column=True)
        steps["top_k"] = TopK(rows.of(requests, sampled), kth_index, max(ks))
    return steps


def _stage_top_k_groups(rows: RowIndex, pipelines, sampled: list[int], grouped: set[int]):
    """One group per k of the ``grouped`` requests (W depends on k alone: each row gets the
    bits the reference gives it)."""
    groups = []
    for top_k in sorted({pipelines[i].params.top_k for i in grouped}):
        requests = [i for i in sampled if i in grouped and pipelines[i].params.top_k == top_k]
        temperatures = rows.per_row(requests, lambda i: pipelines[i].params.temperature)
        temperature = None if set(temperatures) == {1.0} else rows.staged.floats(temperatures)
        slots = rows.of(requests, sampled)
        groups.append(TopKGroup(top_k, rows.of(requests), slots, temperature))
    return tuple(groups)


def _runs(values: list[int]) -> tuple[tuple[int, int, int], ...]:
    """Runs of consecutive values: (first position, first value, length) each."""
    runs = (list(run) for _, run in groupby(enumerate(values), lambda pair: pair[1] - pair[0]))
    return tuple((run[0][0], run[0][1], len(run)) for run in runs)


def raw_greedy(pipelines: Sequence[LogitsPipeline]) -> bool:
    """Every request greedy with logits nothing processes (:attr:`LogitsPipeline.plain`):
    its token is the argmax of its raw logits."""
    return all(pipeline.params.greedy and pipeline.plain for pipeline in pipelines)


def _raw_argmax(
    logits: Sequence[torch.Tensor], candidate_token_ids: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """Requests whose logits nothing processes (greedy, :attr:`LogitsPipeline.plain`): each
    one's argmax ids ``[n_i]`` of its raw rows, what the whole pass gives them, without
    building it (its metadata is host work every round)."""
    for rows, candidates in zip(logits, candidate_token_ids, strict=True):
        _check_rows(rows.shape[0], candidates)
    return raw_argmax_rows(logits)


def raw_argmax_rows(parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each part's (``[n_i, vocab]``) row argmax ids ``[n_i]``, over the rows where they lie
    when they are blocks of one tensor, as a forward's logits are (the cache's row order need
    not be the requests' once rows were refilled): no ``[R, vocab]`` copy of them each round."""
    sizes = [part.shape[0] for part in parts]
    whole = rows_in_place(parts)
    if whole is None:
        return list(row_argmax(torch.cat(list(parts))).split(sizes))
    base, starts = whole  # [span, vocab], each part's first row in it
    ids = row_argmax(base)  # [span]
    return [ids[start : start + size] for start, size in zip(starts, sizes, strict=True)]


def _check_rows(rows: int, candidates: Sequence[int]) -> None:
    if rows < 1 or not rows - 1 <= len(candidates) <= rows:
        raise ValueError(
            f"{rows} logits rows need {rows - 1} candidate tokens (or {rows}), "
            f"got {len(candidates)}"
        )
