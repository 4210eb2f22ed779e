"""The coordinator's bookkeeping of its draft workers: which worker drafts which request, the
calls made to them, and what a failed worker may still hold.

Worker calls execute in order, one at a time. A worker that fails a call is replaced and its
requests go target-only until the replacement has taken them on again; a generation number per
worker tells replies of calls to a replaced worker apart, and requests such a worker may still
hold (it was only slow) are freed once it is back. What the calls measured (bytes, draft time,
failures) goes to the coordinator's recording hooks.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Mapping, Sequence

from specray.engine_core.backends import DraftBackend
from specray.engine_core.block_length import Measurements, draft_prefills_wanted
from specray.engine_core.coordinator_config import CoordinatorConfig
from specray.engine_core.policy import should_draft_ahead
from specray.engine_core.request import DraftPhase, Request
from specray.protocol import DraftItem, PrefillReport, ProposeCall, ProposeReport

log = logging.getLogger(__name__)


class DraftPool:
    """Draft worker assignment, calls and failures for one coordinator.

    ``requests`` is the coordinator's map of requests in flight (read; only the requests in it
    are changed here). ``on_prefill(report, requests)``, ``on_proposal(reply)`` and
    ``on_failure()`` record what came back: every proposal, but prefills and failures of calls
    to the current worker only (a replaced worker's do not count).
    """

    def __init__(
        self,
        drafts: DraftBackend,
        config: CoordinatorConfig,
        requests: Mapping[str, Request],
        *,
        on_prefill: Callable[[PrefillReport, list[Request]], None],
        on_proposal: Callable[[ProposeReport], None],
        on_failure: Callable[[], None],
    ):
        self.drafts, self.config, self._requests = drafts, config, requests
        self._on_prefill, self._on_proposal, self._on_failure = on_prefill, on_proposal, on_failure
        # Incremented when a worker is replaced: failures of calls to an older one are ignored.
        # Keyed by worker index: a pool may grow while serving (autoscaling).
        self._generation: collections.defaultdict[int, int] = collections.defaultdict(int)
        # Requests a draft worker may still hold after it failed a call (worker -> ids).
        self._stale: collections.defaultdict[int, set[str]] = collections.defaultdict(set)
        # Releases, draft prefills and worker replacements under way (see settle).
        self._background: set[asyncio.Future] = set()

    # ---- assignment --------------------------------------------------------------------
    def assign(self, request: Request) -> None:
        """The least-loaded available draft worker of the request's micro-batch (None while
        there is none). With at least as many workers as micro-batches, micro-batch i drafts on
        the workers w with w % num_micro_batches == i: a worker's calls run one at a time, so a
        worker shared by two micro-batches drafts them in turn and the draft of one no longer
        hides behind the other's verification (a draft step on a GPU costs about the same for
        1 request as for 8)."""
        request.draft_worker = None
        if request.max_k == 0:
            return
        available = [w for w in range(self.drafts.num_workers) if self.drafts.available(w)]
        groups = self.config.num_micro_batches
        own = [w for w in available if w % groups == request.batch_index % groups]
        load = dict.fromkeys(own if len(available) >= groups and own else available, 0)
        for other in self._requests.values():
            if other.draft_worker in load:
                load[other.draft_worker] += 1
        if load:
            request.draft_worker = min(load, key=load.__getitem__)

    # ---- calls -------------------------------------------------------------------------
    def start_wanted_prefills(
        self, batch: Sequence[Request], measured: Callable[[], Measurements]
    ) -> None:
        """Hand requests of ``batch`` the draft workers have not seen to them, as many as
        :func:`~specray.engine_core.block_length.draft_prefills_wanted` says for the
        ``measured()`` costs (fixed-k requests are taken on by their first propose call)."""
        if self.config.num_speculative_tokens == 0:
            return
        fresh = [r for r in batch if r.draft_phase is DraftPhase.UNSEEN and not r.fixed_k]
        if not fresh:  # the usual round: nothing to decide
            return
        untried = sum(
            1 for r in batch if r.draft_phase is not DraftPhase.UNSEEN and not r.probe.tried
        )
        wanted = draft_prefills_wanted(
            len(fresh), untried, len(batch), measured(), self.config, has_drafts=True
        )
        self.start_prefills(fresh[:wanted])

    def start_prefills(self, requests: list[Request]) -> None:
        """Hand requests the draft workers have not seen to them (reassigning those whose
        worker left the pool, or had none); they go target-only meanwhile."""
        fresh: dict[int, list[Request]] = {}
        for request in requests:
            if request.draft_phase is DraftPhase.UNSEEN and request.max_k > 0:
                worker = request.draft_worker
                if worker is None or not self.drafts.available(worker):
                    self.assign(request)  # its worker left the pool, or none was
            worker = request.draft_worker
            if worker is None:
                continue
            if request.draft_phase is DraftPhase.UNSEEN and self.drafts.available(worker):
                fresh.setdefault(worker, []).append(request)
        for worker, new in fresh.items():
            generation = self._generation[worker]
            items = tuple(self.draft_item(request, 0) for request in new)
            future = asyncio.ensure_future(self.drafts.prefill(worker, items))
            for request in new:
                request.draft_prefill_started(future)
            self._background.add(future)
            future.add_done_callback(self._background.discard)
            future.add_done_callback(
                lambda f, new=new, worker=worker, generation=generation: self._prefill_done(
                    f, new, worker, generation
                )
            )

    def _prefill_done(
        self, future: asyncio.Future, requests: list[Request], worker: int, generation: int
    ) -> None:
        if future.cancelled():  # the coordinator stopped while the draft prefilled
            return
        if future.exception() is not None:
            self._failed(worker, generation, future.exception())
            return
        if generation == self._generation[worker]:
            self._on_prefill(future.result(), requests)
            for request in requests:
                request.draft_prefilled()

    def propose(self, blocks: list[tuple[Request, int]]) -> dict[tuple[int, int], asyncio.Future]:
        """Ask each draft worker for its requests' blocks of ``k`` tokens (they stream them to
        the target). Returns the calls by (worker, generation), for :meth:`watch`."""
        by_worker: dict[int, list[DraftItem]] = {}
        for request, k in blocks:
            by_worker.setdefault(request.draft_worker, []).append(self.draft_item(request, k))
        return {
            (worker, self._generation[worker]): asyncio.ensure_future(
                self.drafts.propose(worker, ProposeCall(tuple(items), self.config.draft_ahead))
            )
            for worker, items in by_worker.items()
        }

    def watch(self, proposals: dict[tuple[int, int], asyncio.Future]) -> None:
        """Record the replies of :meth:`propose`'s calls as they arrive (in the background)."""
        for key, future in proposals.items():
            future.add_done_callback(lambda f, key=key: self._proposal_done(f, *key))

    def _proposal_done(self, future: asyncio.Future, worker: int, generation: int) -> None:
        try:
            reply = future.result()
        except Exception as error:  # the worker died or its call failed: replace it
            self._failed(worker, generation, error)
            return
        self._on_proposal(reply)

    def draft_item(self, request: Request, k: int) -> DraftItem:
        """What a draft worker is told about a request: its new committed tokens (all of them,
        and its spec, on first contact) and a block of ``k`` tokens (0: a prefill)."""
        state = request.state
        ahead = True
        if k > 0 and self.config.draft_ahead:  # drafts before the verdict: only if kept likely
            acceptance = request.estimator.acceptance(k + 1)
            ahead = should_draft_ahead(acceptance, k, self.config.draft_ahead_min_hit)
        first_contact = request.draft_phase is DraftPhase.UNSEEN
        item = DraftItem(
            state.request_id,
            request.step,
            k,
            len(state.output_token_ids),
            tuple(state.output_token_ids[0 if first_contact else request.draft_known :]),
            spec=state.to_spec(with_output=False) if first_contact else None,
            ahead=ahead,
        )
        request.draft_known = len(state.output_token_ids)
        if first_contact and k > 0:
            request.draft_taken_on()
        return item

    # ---- failures ----------------------------------------------------------------------
    def lost(self, worker: int, error: BaseException) -> None:
        """The worker is gone (its stream closed): as a failed call to its current process."""
        self._failed(worker, self._generation[worker], error)

    def _failed(self, worker: int, generation: int, error: BaseException) -> None:
        """A call to ``worker`` failed: unless it was a call to a worker already replaced,
        its requests go target-only and a replacement starts."""
        if generation != self._generation[worker]:
            return  # a call to a worker that was already replaced
        self._generation[worker] += 1
        log.warning("draft worker %d failed (%s); continuing target-only", worker, error)
        self._on_failure()
        for request in self._requests.values():
            if request.draft_worker == worker:
                request.draft_lost()
                # If the worker was only slow it comes back holding this state: freed then.
                self._stale[worker].add(request.state.request_id)
        replacement = asyncio.ensure_future(self.drafts.replace(worker))
        self._background.add(replacement)
        replacement.add_done_callback(self._background.discard)

    # ---- releases ----------------------------------------------------------------------
    async def settle(self, timeout_s: float) -> None:
        """On stop: give releases, draft prefills and worker replacements still under way a
        moment (a release frees a worker's KV cache), then cancel what is left."""
        if self._background:
            _, pending = await asyncio.wait(set(self._background), timeout=timeout_s)
            for future in pending:
                future.cancel()

    async def release(self, requests: list[Request]) -> None:
        """Free what the draft workers hold for these requests (those still being prefilled
        once their prefill is in), and what failed workers still hold."""
        for worker in range(self.drafts.num_workers):
            ids = []
            for r in requests:
                if r.draft_worker != worker or r.draft_phase is DraftPhase.UNSEEN:
                    continue
                if r.draft_prefill is not None and not r.draft_prefill.done():
                    # Released now, the prefill arriving after would leave state behind.
                    r.draft_prefill.add_done_callback(
                        lambda _, w=worker, rid=r.state.request_id: self._release_later(w, rid)
                    )
                else:
                    ids.append(r.state.request_id)
            if ids and self.drafts.available(worker):
                try:
                    await self.drafts.release(worker, ids)
                except Exception as error:  # a dead worker holds nothing; it is being replaced
                    log.warning("draft worker %d release failed: %s", worker, error)
        await self.release_stale()

    def _release_later(self, worker: int, request_id: str) -> None:
        task = asyncio.ensure_future(self._release_one(worker, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_one(self, worker: int, request_id: str) -> None:
        if not self.drafts.available(worker):
            return  # a worker gone holds nothing
        try:
            await self.drafts.release(worker, [request_id])
        except Exception as error:
            log.warning("draft worker %d release failed: %s", worker, error)

    async def release_stale(self) -> None:
        """Free state a draft worker kept after it failed a call and came back (only for
        requests not assigned to it again: those it prefills anew)."""
        for worker, stale in list(self._stale.items()):
            if not stale or not self.drafts.available(worker):
                continue
            ids = [
                request_id
                for request_id in stale
                if (request := self._requests.get(request_id)) is None
                or request.draft_worker != worker
            ]
            if not ids:
                continue
            try:
                await self.drafts.release(worker, ids)
                stale.difference_update(ids)
            except Exception as error:
                log.warning("draft worker %d: stale release failed: %s", worker, error)
