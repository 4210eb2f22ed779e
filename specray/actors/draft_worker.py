"""DraftWorker: a Ray actor that drafts blocks for many requests and streams them, with the
exact encoded q they were sampled from, straight to the target group's rank 0 over gRPC.

q takes one hop (draft -> target); the caller only tells the worker which requests to draft.
The worker keeps one long-lived bidirectional stream and reopens it if it breaks.

A feature-conditioned draft reads the target's hidden states h_i: each block says how many
leading rows the worker holds for its request, and the verdict brings the rest (the reader
thread stores them). A call may come before the verdict with the newest rows, and a fault may
lose some: the worker waits a bounded time for them, then drafts with what it has (the drafter
is tolerant: missing rows are chained features, recomputed when the rows come). Features only
shape q, which the draft samples from exactly, so none of this can change the output law.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from specray.actors.draft_link import DraftLink, LocalDraftLink
from specray.core import RequestState, eos_token_ids
from specray.drafters import DraftRequest, FeatureDrafter, make_drafter
from specray.feature_rows import FeatureRows
from specray.models.device import worker_device
from specray.models.loading import LoadedModel, load_model, load_tokenizer, resolve_model_dir
from specray.models.runner import ModelRunner
from specray.protocol import (
    DraftCommand,
    DraftItem,
    DraftReply,
    PrefillReport,
    ProposeCall,
    ProposeReport,
)
from specray.rpc.faults import LinkFaults
from specray.rpc.messages import (
    InvalidMessageError,
    block_to_pb,
    check_verdict_features,
)
from specray.sampling import DraftProbsEncoding, EncodedDraftProbs, stack_rows
from specray.sampling.grammar import lazy_grammars

log = logging.getLogger(__name__)
# How long a propose waits for the verdict carrying a request's newest target feature rows.
# The target writes a verdict to the stream before its round returns to the coordinator, which
# only then asks for the next block, so the rows are normally here or a network hop away; the
# bound only caps the cost of a verdict that never comes (a dropped block, a broken stream, a
# restarted target): missing rows cost acceptance, never exactness, and far less than stalling
# the target's round (its draft deadline is seconds).
FEATURE_WAIT_S = 0.05
# How long a draft-ahead with nothing left to draft waits for a verdict, to draft the next block
# from it: any other call ends the wait at once, so it only bounds idling on a lost verdict.
VERDICT_WAIT_S = 2.0


@dataclass(frozen=True)
class _Drafted:
    token_id: int
    # [1, ...]: the q row it was sampled from, in wire form; None for a committed token a
    # verdict brought (history to draft from, never sent)
    encoded: EncodedDraftProbs | None


class DraftWorker:
    def __init__(
        self,
        target: str,
        draft: str,
        draft_probs_encoding: str = "fp32",
        num_threads: int = 1,
        device: str = "auto",  # specray/models/device.py; the GPU is the one Ray gave
    ):
        import torch

        torch.set_num_threads(num_threads)
        self.device = worker_device(device)
        target_dir = resolve_model_dir(target, param="target")
        tokenizer = load_tokenizer(target_dir)
        # The drafter needs the target's files and tokenizer, not its weights.
        target_ref = LoadedModel(model=None, tokenizer=tokenizer, path=target_dir)
        config_vocab = _vocab_size(target_dir)
        self.encoding = DraftProbsEncoding.parse(draft_probs_encoding)
        self.drafter = make_drafter(
            draft, target_ref, config_vocab, self.encoding, keep_encoded=True, device=self.device
        )
        self.vocab_size = config_vocab
        # The target's grammar masks on q too (the drafter follows the grammar it is judged by)
        self.grammars = lazy_grammars(tokenizer, config_vocab, eos_token_ids(None, tokenizer))
        self.feature_drafter = next(
            (d for d in (self.drafter, getattr(self.drafter, "then", None))
             if isinstance(d, FeatureDrafter)),
            None,
        )  # fmt: skip
        if self.feature_drafter is not None:
            self.feature_drafter.tolerant = True  # rows come over the network, maybe late
        # Target feature rows per request (written by the verdict reader thread, read by
        # propose under _features_ready), and the latest step a block was sent for.
        self._features: dict[str, FeatureRows] = {}
        self._features_ready = threading.Condition()
        self._sent_step: dict[str, int] = {}
        self.verdict_faults = LinkFaults()  # on the verdicts received; the chaos suite only
        self.feature_rows_received = 0
        self.feature_bytes_received = 0
        self.feature_rows_lost = 0  # rows after a gap (lost earlier ones): asked for again
        self.feature_waits_timed_out = 0
        # A self-draft (the target's weights at a cheaper precision) prefills with the target's
        # fp32 weights on the CPU: bf16 prefill is ~4x slower there, and a draft is only a
        # proposal. On a GPU its own half-precision prefill is fast: no second copy is loaded.
        self._prefill_source = None
        shares = getattr(self.drafter, "shares_target_architecture", False)
        if shares and self.device.type == "cpu":
            self._prefill_source = ModelRunner(load_model(str(target_dir), param="target").model)
        self.requests: dict[str, RequestState] = {}
        # Tokens drafted past the committed ones (the last block and drafts made ahead), with
        # the exact encoded q each was sampled from, and the committed count they start at.
        self.speculated: dict[str, list[_Drafted]] = {}
        self._spec_base: dict[str, int] = {}
        # Each request's latest verdict: (step, the tokens it committed). A draft-ahead stops
        # at it, folds the tokens in and drafts the next block from the true history.
        self._verdicts: dict[str, tuple[int, list[int]]] = {}
        self.folded_verdicts = 0
        self._lock = threading.Lock()  # one drafting call at a time
        self._queue_lock = threading.Lock()
        self._calls_waiting = 0  # calls blocked on _lock: draft-ahead yields to them
        self.link: DraftLink | None = None
        self._stopped = threading.Event()
        self.verdicts_received = 0
        self.link_faults = LinkFaults()  # none unless the chaos suite injects them
        self.blocks_dropped_by_faults = 0
        self.bytes_sent = 0
        self.busy_s = 0.0  # time spent drafting (its utilisation drives draft autoscaling)
        self._idle_s = 0.0  # of the current call: waiting for verdicts, not drafting

    # ---- the stream to the engine core -------------------------------------------------
    def connect(self, target_address: str, worker_id: str | None = None) -> str:
        """Open the stream to the target group's rank 0; returns this worker's id there. A
        worker moved to another engine core (its group restarted or was replaced) first
        forgets what the previous one gave it: that one is gone, and the new one never saw
        those requests (they would be held for ever)."""
        if self.link is not None:
            self.link.close(timeout_s=30)
            self.release(list(self.requests))
        self.link = DraftLink(target_address, **self._link_callbacks(), worker_id=worker_id)
        return self.link.worker_id

    def connect_local(self, verifier) -> str:
        """Link to the engine core of this process (``verifier``: the target's
        :class:`~specray.rpc.server.VerifierServicer`): a draft colocated with its target
        (``draft_placement="colocated"``) exchanges the same messages in memory."""
        self.link = LocalDraftLink(verifier, **self._link_callbacks())
        return self.link.worker_id

    def _link_callbacks(self) -> dict:
        return {
            "take_verdict": self._on_verdict,
            "run_command": self._run_command,
            "on_arrival": self._wake,
        }

    def _run_command(self, command: DraftCommand) -> DraftReply | None:
        """One command from the engine core: free, take on, then draft (the link's thread)."""
        try:
            if command.release:
                self.release(list(command.release))
            prefill = self.prefill(command.prefill) if command.prefill else None
            propose = self.propose(command.propose) if command.propose is not None else None
        except Exception as error:  # the engine core treats this worker as failed
            log.exception("draft command %d failed", command.seq)
            return DraftReply(command.seq, error=f"{type(error).__name__}: {error}")
        if prefill is None and propose is None:
            return None
        return DraftReply(command.seq, prefill, propose)

    def _yield_now(self) -> bool:
        """Another call or command is waiting for the drafter: a draft-ahead stops."""
        return bool(self._calls_waiting or (self.link is not None and self.link.commands_waiting))

    def _wake(self) -> None:
        with self._features_ready:  # a draft-ahead waiting for a verdict looks again
            self._features_ready.notify_all()

    def _on_verdict(self, verdict) -> None:
        self.verdicts_received += 1
        fate = self.verdict_faults.fate() if self.verdict_faults.active else 0.0
        if fate:
            threading.Timer(fate, self._take_verdict, (verdict,)).start()
        elif fate is not None:
            self._take_verdict(verdict)

    def _take_verdict(self, verdict) -> None:
        """Note the verdict's step (stops a draft-ahead) and store its target feature rows."""
        if self.feature_drafter is not None:
            self._receive_features(verdict)
        with self._features_ready:
            if verdict.request_id not in self.requests:  # released meanwhile: nothing to keep
                return
            if verdict.step >= self._verdict_step(verdict.request_id):
                self._verdicts[verdict.request_id] = (verdict.step, list(verdict.token_ids))
            self._features_ready.notify_all()

    def _receive_features(self, verdict) -> None:
        """Store a verdict's target feature rows (the reader thread)."""
        try:
            received = check_verdict_features(verdict, self.feature_drafter.feature_size)
        except InvalidMessageError as error:
            log.warning("dropping invalid target features of %s: %s", verdict.request_id, error)
            return
        if received is None:
            return
        start, rows = received  # rows: [n, hidden]
        self.feature_bytes_received += len(verdict.target_features.data)
        with self._features_ready:
            store = self._features.get(verdict.request_id)
            if store is None:  # released meanwhile
                return
            if store.write(start, rows):
                self.feature_rows_received += len(rows)
            else:  # the next block declares what is held, and the target resends the rest
                self.feature_rows_lost += len(rows)
            self._features_ready.notify_all()

    def inject_verdict_faults(
        self, delay_s: float = 0.0, drop_fraction: float = 0.0, seed: int = 0
    ) -> None:
        """Delay or drop the verdicts (and the feature rows they bring) this worker receives
        (the chaos suite); zeros turn it off."""
        self.verdict_faults = LinkFaults(delay_s, drop_fraction, seed)

    def inject_link_faults(
        self, delay_s: float = 0.0, drop_fraction: float = 0.0, seed: int = 0
    ) -> None:
        """Delay or drop the blocks this worker sends (the chaos suite); zeros turn it off."""
        self.link_faults = LinkFaults(delay_s, drop_fraction, seed)

    # ---- drafting ----------------------------------------------------------------------
    def propose(self, call: ProposeCall) -> ProposeReport:
        """Draft for each request and stream the blocks to the target.

        Each item names the step and its block length ``k``, and brings the committed tokens
        this worker has not seen (all of them, with the request's spec, on first sight). With
        ``call.draft_ahead``, after sending, the
        worker keeps drafting past each block (as if it were fully accepted and the bonus token
        were its own next draft) until the verdict arrives, then from the tokens the verdict
        committed up to a next block of k, while no other call is waiting. The next call keeps
        the drafts whose assumed history was committed.
        """
        round_spec = call.items
        with self._turn():
            started = time.perf_counter()
            states = [self._sync_state(item) for item in round_spec]
            if self.feature_drafter is not None:
                self._await_features(states)
            reused = [len(self._reusable(state)) for state in states]  # before extending
            steps = self._extend(states, [item.k for item in round_spec])
            ready, delayed = [], []
            for item, state in zip(round_spec, states, strict=True):
                block = self.speculated[state.request_id][: item.k]
                message = block_to_pb(
                    state.request_id,
                    item.step,
                    len(state.output_token_ids),
                    [entry.token_id for entry in block],
                    stack_rows([entry.encoded for entry in block]) if block else None,
                    len(self._features.get(state.request_id, ())),
                )
                fate = self.link_faults.fate() if self.link_faults.active else 0.0
                if fate is None:
                    self.blocks_dropped_by_faults += 1
                    continue
                self._sent_step[state.request_id] = item.step
                (delayed if fate else ready).append(message)
                if fate:
                    self.link.send_later(fate, [message])
            # One message for the whole call, whatever the batch size.
            sent_bytes = sum(message.ByteSize() for message in delayed)
            sent_bytes += self.link.send_blocks(ready)
            ahead = 0
            if call.draft_ahead:
                ahead, ahead_steps = self._draft_ahead(round_spec, states)
                steps += ahead_steps
            self.bytes_sent += sent_bytes
            return ProposeReport(
                num_requests=len(states),
                bytes=sent_bytes,
                draft_s=time.perf_counter() - started - self._idle_s,  # drafting only
                steps=steps,
                reused_tokens=sum(
                    min(count, item.k) for count, item in zip(reused, round_spec, strict=True)
                ),
                ahead_tokens=ahead,
            )

    def prefill(self, items: Sequence[DraftItem]) -> PrefillReport:
        """Take on new requests: their state and the draft's KV cache of their committed tokens
        (items as for :meth:`propose`, ``k`` unused). The coordinator runs them target-only
        meanwhile, so a slow draft prefill never holds the target up."""
        with self._turn():
            started = time.perf_counter()
            states = [self._sync_state(item) for item in items]
            prefill = getattr(self.drafter, "prefill", None)
            if prefill is not None:
                prefill([self._draft_request(state, 1) for state in states], self._prefill_source)
            return PrefillReport(len(states), time.perf_counter() - started)

    @contextlib.contextmanager
    def _turn(self):
        """Hold the drafter; while waiting for it, a draft-ahead in progress yields."""
        with self._queue_lock:
            self._calls_waiting += 1
        with self._features_ready:  # a draft-ahead waiting for a verdict yields at once
            self._features_ready.notify_all()
        with self._lock:
            with self._queue_lock:
                self._calls_waiting -= 1
            started = time.perf_counter()
            try:
                yield
            finally:
                self.busy_s += time.perf_counter() - started - self._idle_s
                self._idle_s = 0.0

    def _await_features(self, states: list[RequestState]) -> None:
        """Wait (at most FEATURE_WAIT_S) for rows h_0 .. h_{T-2} of requests whose last block's
        verdict, which brings them, has not arrived yet; then draft with what is here."""
        deadline = time.monotonic() + FEATURE_WAIT_S
        with self._features_ready:
            while True:
                waiting = [
                    state
                    for state in states
                    if self._verdict_step(state.request_id)
                    < self._sent_step.get(state.request_id, -1)
                    and len(self._features[state.request_id]) < self._num_tokens(state) - 1
                ]
                remaining = deadline - time.monotonic()
                if not waiting:
                    return
                if remaining <= 0:
                    self.feature_waits_timed_out += 1
                    return
                self._features_ready.wait(remaining)

    def _verdict_step(self, request_id: str) -> int:
        """The step of the latest verdict seen for a request (-1: none yet)."""
        return self._verdicts.get(request_id, (-1, None))[0]

    @staticmethod
    def _num_tokens(state: RequestState) -> int:
        return len(state.prompt_token_ids) + len(state.output_token_ids)

    def _sync_state(self, item: DraftItem) -> RequestState:
        state = self.requests.get(item.request_id)
        if state is not None and item.spec is not None:
            # First contact again (the coordinator gave up on this worker once, and came
            # back): what is held here is stale; start over from the item.
            self._forget([item.request_id])
            state = None
        if state is None:
            if item.spec is None:
                raise ValueError(f"draft worker has no state for request {item.request_id}")
            state = RequestState.from_spec(item.spec, self.vocab_size, frozenset(), self.grammars)
            self.requests[state.request_id] = state
            self.speculated[state.request_id] = []
            self._spec_base[state.request_id] = 0
            if self.feature_drafter is not None:
                with self._features_ready:
                    self._features[state.request_id] = FeatureRows(
                        self.feature_drafter.feature_size
                    )
        state.output_token_ids.extend(item.new_token_ids)
        if len(state.output_token_ids) != item.num_committed:
            raise ValueError(
                f"request {state.request_id}: the draft has {len(state.output_token_ids)} "
                f"committed tokens, the coordinator says {item.num_committed}"
            )
        return state

    def _reusable(self, state: RequestState) -> list:
        """Drafts made earlier whose assumed history is now committed (they are kept)."""
        request_id = state.request_id
        base, speculated = self._spec_base[request_id], self.speculated[request_id]
        committed_since = state.output_token_ids[base:]
        assumed = [entry.token_id for entry in speculated[: len(committed_since)]]
        if len(committed_since) > len(speculated) or assumed != committed_since:
            speculated = []
        else:
            speculated = speculated[len(committed_since) :]
        if any(entry.encoded is None for entry in speculated):  # a folded verdict's token
            speculated = []  # (only ever kept as committed history, never sent as a draft)
        self.speculated[request_id] = speculated
        self._spec_base[request_id] = len(state.output_token_ids)
        return speculated

    def _extend(self, states: list[RequestState], targets: list[int]) -> int:
        """Draft until each request has ``targets[i]`` tokens speculated; returns the steps."""
        steps = 0
        while True:
            asks = [
                (state, target - len(self.speculated[state.request_id]))
                for state, target in zip(states, targets, strict=True)
                if len(self.speculated[state.request_id]) < target
            ]
            if not asks:
                return steps
            requests = [self._draft_request(state, missing) for state, missing in asks]
            for (state, _), block in zip(asks, self.drafter.propose(requests), strict=True):
                self.speculated[state.request_id].extend(
                    _Drafted(token, block.encoded.row(index))
                    for index, token in enumerate(block.token_ids)
                )
                if not block.token_ids:  # the drafter has nothing more to say
                    targets[states.index(state)] = len(self.speculated[state.request_id])
            steps += max(missing for _, missing in asks)

    def _draft_ahead(
        self, round_spec: Sequence[DraftItem], states: list[RequestState]
    ) -> tuple[int, int]:
        """Draft one token at a time past the blocks while nothing else is waiting: until the
        verdict, as if the block were fully accepted and the bonus token were the next draft;
        once the verdict is here, from the history it committed, up to a next full block (so
        the next call finds its block drafted instead of starting after the round trip)."""
        drafted = steps = 0
        deadline = time.monotonic() + VERDICT_WAIT_S
        while not self._yield_now():
            open_ = []
            for item, state in zip(round_spec, states, strict=True):
                request_id, limit = state.request_id, 2 * item.k + 1
                if not item.ahead:  # before the verdict: not worth it (policy)
                    limit = item.k
                if self._verdict_step(request_id) >= item.step:
                    folded = self._fold_verdict(state, item.step)
                    if folded is None:
                        continue
                    limit = folded + item.k
                if len(self.speculated[request_id]) < limit:
                    open_.append(state)
            if not open_:
                if not self._await_verdict(round_spec, states, deadline):
                    break
                continue
            targets = [len(self.speculated[state.request_id]) + 1 for state in open_]
            before = sum(len(self.speculated[state.request_id]) for state in open_)
            steps += self._extend(open_, targets)
            added = sum(len(self.speculated[state.request_id]) for state in open_) - before
            if not added:
                break
            drafted += added
        return drafted, steps

    def _await_verdict(self, round_spec, states, deadline: float) -> bool:
        """Wait (idle) for a verdict still due for this call's blocks; False when none is due,
        another call is waiting, or the deadline passed."""
        started = time.perf_counter()
        try:
            with self._features_ready:
                while not self._yield_now():
                    due = any(
                        self._verdict_step(state.request_id) < item.step
                        for item, state in zip(round_spec, states, strict=True)
                    )
                    remaining = deadline - time.monotonic()
                    if not due or remaining <= 0:
                        return False
                    if self._features_ready.wait(remaining) and not self._yield_now():
                        return True  # a verdict (or rows) arrived: look again
                return False
        finally:
            self._idle_s += time.perf_counter() - started

    def _fold_verdict(self, state: RequestState, step: int) -> int | None:
        """Make the speculated tokens start with what the verdict of ``step`` committed: the
        accepted drafts, then its last token (kept if it is the draft's own next draft, else
        put in as committed history, without q). Returns how many speculated tokens are now
        committed ones; None if there is nothing to draft (another step's verdict, a verdict
        that does not extend these drafts, or a request at its last token)."""
        request_id = state.request_id
        with self._features_ready:
            verdict_step, tokens = self._verdicts.get(request_id, (-1, []))
        speculated = self.speculated[request_id]
        accepted = len(tokens) - 1
        if verdict_step != step or accepted < 0 or accepted > len(speculated):
            return None
        if [entry.token_id for entry in speculated[:accepted]] != tokens[:accepted]:
            return None
        if len(state.output_token_ids) + len(tokens) >= state.params.max_tokens:
            return None
        if len(speculated) == accepted or speculated[accepted].token_id != tokens[-1]:
            self.speculated[request_id] = [*speculated[:accepted], _Drafted(tokens[-1], None)]
            self.folded_verdicts += 1
        return len(tokens)

    def _draft_request(self, state: RequestState, num_tokens: int) -> DraftRequest:
        history = [*state.output_token_ids, *self._tokens(state.request_id)]
        features = None
        if self.feature_drafter is not None:
            with self._features_ready:  # rows of committed positions only: [<= T - 1, hidden]
                features = self._features[state.request_id].view(self._num_tokens(state) - 1)
        return DraftRequest(
            state.request_id,
            state.prompt_token_ids,
            history,
            state.pipeline,
            state.random,
            num_tokens,
            target_features=features,
        )

    def _tokens(self, request_id: str) -> list[int]:
        return [entry.token_id for entry in self.speculated[request_id]]

    def calibrate(self, batches: list[int]) -> list[tuple[int, float]]:
        """Time one draft step per batch size: the draft cost model (0 for model-free drafts)."""
        runner = getattr(self.drafter, "runner", None)
        with self._turn():
            return [(batch, runner.time_forward(batch, 1) if runner else 0.0) for batch in batches]

    def release(self, request_ids: list[str]) -> None:
        with self._turn():  # also ends a draft-ahead's wait for a verdict
            self._forget(request_ids)

    def _forget(self, request_ids: list[str]) -> None:
        self.drafter.release(request_ids)
        with self._features_ready:
            for request_id in request_ids:
                self.requests.pop(request_id, None)
                self.speculated.pop(request_id, None)
                self._spec_base.pop(request_id, None)
                self._verdicts.pop(request_id, None)
                self._sent_step.pop(request_id, None)
                self._features.pop(request_id, None)

    def held_requests(self) -> list[str]:
        return sorted(self.requests)

    def lifeline(self) -> None:
        """Returns only when this worker stops: its caller learns at once that it died."""
        self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()
        if self.link is not None:
            self.link.close()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def stats(self) -> dict:
        return {
            "verdicts_received": self.verdicts_received,
            "ray_calls": dict(getattr(self, "ray_calls", {})),
            "messages_sent": self.link.messages_sent if self.link else 0,
            "messages_received": self.link.messages_received if self.link else 0,
            "folded_verdicts": self.folded_verdicts,
            "bytes_sent": self.bytes_sent,
            "busy_s": self.busy_s,
            "num_requests": len(self.requests),
            "feature_rows_received": self.feature_rows_received,
            "feature_bytes_received": self.feature_bytes_received,
            "feature_rows_lost": self.feature_rows_lost,
            "feature_waits_timed_out": self.feature_waits_timed_out,
            "feature_rows_fed": getattr(self.feature_drafter, "target_rows_fed", 0),
            "feature_rows_without_target": getattr(self.feature_drafter, "rows_without_target", 0),
        }


def _vocab_size(model_dir) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_dir, local_files_only=True).vocab_size)
