"""The coordinator's record of one request in flight, and its lifecycle on the workers.

A request meets two kinds of worker, each holding state for it (a KV cache) that the coordinator
must hand over, wait for and free: the target group, which prefills its context (in chunks under
a prefill budget) and then verifies its blocks, and the draft worker assigned to it, which takes
it on in a separate prefill call before it may draft. Each side has its own phase, and every
change of phase is one of the methods below, so the lifecycle reads in one place:

================  ===========================  ===============================================
side              transition                   when
================  ===========================  ===============================================
target            NEW -> PREFILLING            a round first sends it (with its spec)
target            PREFILLING -> PREFILLING     a round cached a chunk of its context
target            PREFILLING -> DECODING       a round committed its first tokens
target            PREFILLING|DECODING          it finished (the target frees it itself) or
                  -> RELEASED                  the coordinator released it (cancel, deadline)
draft             UNSEEN -> PREFILLING         a prefill call hands it to its draft worker
draft             PREFILLING -> READY          that call came back (from the current worker)
draft             UNSEEN -> READY              a fixed-k request: its first propose takes it on
draft             any -> UNSEEN                its draft worker failed (a replacement knows none)
================  ===========================  ===============================================
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from specray.core import RequestState
from specray.engine_core.block_length import RequestProbe
from specray.engine_core.policy import AcceptanceEstimator
from specray.engine_core.streams import RequestStream
from specray.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    RequestCancelledError,
    SpecrayError,
)
from specray.outputs import RequestOutput
from specray.protocol import VerifyResult


class TargetPhase(enum.Enum):
    """Where a request stands with the target group."""

    NEW = "new"  # the target has not seen it: its next round sends its spec
    PREFILLING = "prefilling"  # the target holds it; context cached up to target_prefilled
    DECODING = "decoding"  # its whole context is cached: it decodes, and may speculate
    RELEASED = "released"  # the target holds nothing for it any more


_HELD = (TargetPhase.PREFILLING, TargetPhase.DECODING)  # the target holds state for it
_HELD_OR_NEW = (TargetPhase.NEW, *_HELD)


class DraftPhase(enum.Enum):
    """Where a request stands with its draft worker."""

    UNSEEN = "unseen"  # no draft worker holds it (never handed over, or its worker failed)
    PREFILLING = "prefilling"  # a prefill call to its draft worker is under way
    READY = "ready"  # its draft worker holds its state: it may draft


def _expect(phase: enum.Enum, allowed: tuple[enum.Enum, ...], to: enum.Enum) -> None:
    if phase not in allowed:  # a bookkeeping bug: fail loudly rather than leak worker state
        raise RuntimeError(f"{phase} cannot move to {to}")


@dataclass
class Request:
    """One request in flight: its committed tokens (the source of truth), its stream, and
    where it stands with the workers (see the module docstring for the transitions)."""

    state: RequestState
    stream: RequestStream
    arrival_s: float
    deadline_s: float | None  # on the loop's clock
    estimator: AcceptanceEstimator
    max_k: int  # this request's largest k (0: it never speculates)
    # always max_k: speculation "on", or seeded under reproducible_seeds (see the config)
    fixed_k: bool = False
    draft_worker: int | None = None
    batch_index: int = 0  # the micro-batch it joined (its draft worker group)
    last_k: int = 0  # the k of its latest round
    last_drafted_step: int = 0  # its step when it last drafted (0: never)
    probe: RequestProbe = field(default_factory=RequestProbe)  # its own probing
    target_phase: TargetPhase = TargetPhase.NEW
    target_prefilled: int = 0  # context tokens the target has cached (chunked prefill)
    draft_phase: DraftPhase = DraftPhase.UNSEEN
    draft_known: int = 0  # committed tokens its draft worker has seen (unless UNSEEN)
    draft_prefill: asyncio.Future | None = None  # the prefill call of its PREFILLING phase
    step: int = 0
    cancelled: bool = False  # abort() or stop(drain=False): ended at its next block boundary
    finish_now: bool = False  # finish(): a front end matched a stop string; ends as finished
    admitted_s: float | None = None  # joined a micro-batch (left the queue)
    first_token_s: float | None = None
    last_emit_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)

    @property
    def target_context(self) -> int:
        """Tokens the target caches before decoding: the prompt (and any committed output, as
        after a replay) but the pending token."""
        return len(self.state.prompt_token_ids) + len(self.state.output_token_ids) - 1

    @property
    def target_holds(self) -> bool:
        """The target holds state for it: releasing it must free that state."""
        return self.target_phase in _HELD

    # ---- log-probabilities (specray.sampling.logprobs) ----------------------------------
    def take_prompt_logprobs(self, result: VerifyResult) -> None:
        """Keep the prompt positions a round cached, by position (a replayed chunk repeats)."""
        if result.prompt_logprobs:
            kept = self.state.prompt_logprobs
            del kept[result.prompt_logprobs_from :]
            kept.extend(result.prompt_logprobs)

    def take_logprobs(self, result: VerifyResult, first: bool) -> tuple[list | None, ...]:
        """Keep the committed tokens' log-probabilities; what their stream delta carries: them,
        and with a request's ``first`` tokens its prompt's (each None unless asked)."""
        params = self.state.params
        self.state.logprobs.extend(result.logprobs)
        logprobs = list(result.logprobs) if params.logprobs is not None else None
        prompt = None
        if first and params.prompt_logprobs is not None:
            prompt = [None, *self.state.prompt_logprobs]
        return logprobs, prompt

    def failure(self) -> InvalidRequestError | None:
        """Why it ended without an output (finish_reason "error": its grammar wanted a token
        the vocabulary lacks), or None."""
        if self.state.error is None:
            return None
        return InvalidRequestError(self.state.error, param="structured_outputs")

    def output(self, tokenizer, now: float) -> RequestOutput:
        """What it has committed, as a front end reports it, with its timings at ``now``."""
        return self.state.to_output(
            tokenizer,
            time_to_first_token_s=(self.first_token_s or now) - self.arrival_s,
            latency_s=now - self.arrival_s,
            chunk_gaps_s=list(self.chunk_gaps_s),
        )

    def leaving(self, now: float) -> bool:
        """Cancelled, finished early by a front end, or past its deadline at ``now``: it is
        removed at its micro-batch's next boundary."""
        return self.cancelled or self.finish_now or bool(self.deadline_s and self.deadline_s <= now)

    def removal_error(self) -> SpecrayError:
        """Why it was removed without finishing: cancelled, or past its deadline."""
        if self.cancelled:
            return RequestCancelledError(f"request {self.state.request_id} was cancelled")
        return self.deadline_error()

    def deadline_error(self) -> DeadlineExceededError:
        return DeadlineExceededError(
            f"request {self.state.request_id} exceeded its deadline after "
            f"{len(self.state.output_token_ids)} tokens"
        )

    # ---- target side ------------------------------------------------------------------
    def sent_to_target(self) -> None:
        """A round carries it (the first one with its spec)."""
        _expect(self.target_phase, _HELD_OR_NEW, TargetPhase.PREFILLING)
        if self.target_phase is TargetPhase.NEW:
            self.target_phase = TargetPhase.PREFILLING

    def target_cached(self, until: int) -> None:
        """A round cached its context up to ``until`` tokens, not all of it: no tokens yet."""
        _expect(self.target_phase, (TargetPhase.PREFILLING,), TargetPhase.PREFILLING)
        self.target_prefilled = until

    def target_decoding(self) -> None:
        """A round committed tokens for it: its whole context is cached."""
        _expect(self.target_phase, _HELD, TargetPhase.DECODING)
        self.target_phase = TargetPhase.DECODING

    def target_released(self) -> None:
        """It finished (the target frees a finished request itself), or the coordinator freed
        its state on the target."""
        _expect(self.target_phase, _HELD, TargetPhase.RELEASED)
        self.target_phase = TargetPhase.RELEASED

    # ---- draft side -------------------------------------------------------------------
    def draft_prefill_started(self, call: asyncio.Future) -> None:
        """A prefill ``call`` hands it to its draft worker; it goes target-only meanwhile."""
        _expect(self.draft_phase, (DraftPhase.UNSEEN,), DraftPhase.PREFILLING)
        self.draft_phase, self.draft_prefill = DraftPhase.PREFILLING, call

    def draft_prefilled(self) -> None:
        """Its prefill call came back from the worker it was made to: it may draft."""
        _expect(self.draft_phase, (DraftPhase.PREFILLING,), DraftPhase.READY)
        self.draft_phase = DraftPhase.READY

    def draft_taken_on(self) -> None:
        """A fixed-k request skips the prefill call: its first propose call takes it on."""
        _expect(self.draft_phase, (DraftPhase.UNSEEN,), DraftPhase.READY)
        self.draft_phase = DraftPhase.READY

    def draft_lost(self) -> None:
        """Its draft worker failed: the replacement knows none of it."""
        self.draft_phase, self.draft_known, self.draft_prefill = DraftPhase.UNSEEN, 0, None
