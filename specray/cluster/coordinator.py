"""The coordinator: admission, continuous batching, block length and pipelining for one target
group. It holds every request's committed tokens (the source of truth) and streams them out.

Pipelining. Running requests are split into ``num_micro_batches`` micro-batches, each driven by
its own round loop: ask the draft workers for blocks (they stream them to the target over gRPC)
and, at the same time, ask the target to verify (it waits for the blocks, then verifies).
Worker calls execute in order, one at a time, so with two micro-batches the draft drafts one
while the target verifies the other. With one micro-batch the draft would idle during
verification; ``draft_ahead`` lets it keep drafting past its block (assuming every token and
its own guess of the bonus token are accepted). Drafts made ahead are kept only when the
committed tokens agree with what they assumed, so they are exactly the drafts a fresh call
would make (keyed randomness): every path stays exact.

Block length. Per micro-batch and round, one K comes from
:func:`specray.cluster.policy.choose_batch_k` on its requests' measured per-position acceptance
and the group's measured costs (verify time as a function of batch and tokens, draft step
time, network round trip): a round costs what its longest block costs, so every request drafts
K (fewer only near its max_tokens). K = 0 runs the batch target-only, and it is probed again
after ``probe_every_rounds`` rounds.

The same code runs on real workers (:mod:`specray.cluster.ray_backends`) and on simulated ones
(:mod:`specray.sim`, a discrete-event clock): all timing uses the event loop's clock.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from specray.cluster.backends import DraftBackend, TargetBackend
from specray.cluster.costs import Costs
from specray.cluster.metrics import CoordinatorMetrics
from specray.cluster.policy import (
    AcceptanceEstimator,
    DraftCost,
    PolicyConfig,
    VerifyCost,
    choose_batch_k,
    choose_k,
    predicted_tokens_per_s,
    prefill_chunks,
    should_draft_ahead,
    should_probe,
)
from specray.cluster.streams import RequestStream
from specray.core import RequestState
from specray.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    RequestCancelledError,
    SpecrayError,
    UnavailableError,
)
from specray.outputs import RequestOutput
from specray.protocol import (
    DraftItem,
    ProposeCall,
    RoundReport,
    VerifyItem,
    VerifyResult,
    VerifyRound,
)
from specray.rpc.messages import MAX_REQUEST_ID_CHARS
from specray.sampling import MAX_SPEC_LEN, SamplingParams
from specray.sampling.rng import random_seed

log = logging.getLogger(__name__)
RTT_PROBE_INTERVAL_S = 0.5  # how often the coordinator times a no-op call to the target
GROUP_ACCEPTANCE_DECAY = 0.99  # the group's running acceptance: new requests start from it
REQUEST_PRIOR_WEIGHT = 4.0  # pseudo-observations of that prior in a request's own estimate
SCOUT_REQUESTS = 2  # requests that re-measure acceptance while the group's says "do not draft"
STOP_GRACE_S = 5.0  # how long stop() waits for releases still under way before cancelling
# Cost priors until measurements arrive (seconds): verification barely growing with tokens and
# a cheap draft, so speculation starts on and the fits take over within a few rounds.
DEFAULT_VERIFY_PRIOR = VerifyCost(fixed_s=0.05, per_request_s=0.01, per_token_s=0.003)
DEFAULT_DRAFT_PRIOR = DraftCost(fixed_s=0.02, per_request_s=0.005)


@dataclass(frozen=True)
class CoordinatorConfig:
    max_running: int = 64  # requests decoded at once (continuous batching)
    max_queue: int = 256  # admitted requests waiting for a slot; beyond: OverloadedError
    num_micro_batches: int = 2  # 1 = unpipelined rounds; 2+ = draft one while verifying another
    num_speculative_tokens: int = 8  # the largest k
    adaptive_k: bool = True  # choose k per request and round from measurements
    draft_ahead: bool = True  # the draft keeps drafting while its block is verified
    # ... before the verdict only for a block kept whole with at least this probability (after
    # it, from the committed tokens, always); 0: always
    draft_ahead_min_hit: float = 0.5
    draft_deadline_s: float = 5.0  # the target waits this long for a block, then goes alone
    # Chunked prefill: per micro-batch round, the target prefills at most this many prompt
    # tokens of requests new to it, first come first served, beside the others' decoding, so a
    # long prompt stalls the running requests for one chunk a round instead of its whole
    # prefill. 0 (default): every prompt whole in its first round. A budget delays new
    # requests (time to first token) and, when many prompts arrive at once, throughput: set
    # it when prompts are long next to what a round decodes.
    max_prefill_tokens_per_round: int = 0
    # A request with a seed drafts a fixed block every round after its first (the most it
    # may: num_speculative_tokens, its own cap, its tokens left - 1), whatever the load or the
    # policy, so its tokens depend on its seed alone, as target-only decoding's do. (A draft
    # worker that fails or misses the deadline still changes that round: it goes
    # target-only, exact but another sample.) Off: seeded requests follow the policy too.
    reproducible_seeds: bool = False
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # Cost priors until measurements arrive (seconds); the online fits replace them.
    verify_prior: VerifyCost = field(default_factory=lambda: DEFAULT_VERIFY_PRIOR)
    draft_prior: DraftCost = field(default_factory=lambda: DEFAULT_DRAFT_PRIOR)
    rtt_prior_s: float = 0.002

    def __post_init__(self) -> None:
        def integer(name: str, low: int, high: int | None = None) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if value < low or (high is not None and value > high):
                bound = f"[{low}, {high}]" if high is not None else f">= {low}"
                raise ValueError(f"{name} must be {bound}, got {value}")

        integer("max_running", 1)
        integer("max_queue", 0)
        integer("num_micro_batches", 1, 16)
        integer("num_speculative_tokens", 0, MAX_SPEC_LEN)
        integer("max_prefill_tokens_per_round", 0)
        for name in ("adaptive_k", "draft_ahead", "reproducible_seeds"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not self.draft_deadline_s > 0:
            raise ValueError(f"draft_deadline_s must be > 0, got {self.draft_deadline_s!r}")
        if not 0 <= self.draft_ahead_min_hit <= 1:
            raise ValueError(
                f"draft_ahead_min_hit must be in [0, 1], got {self.draft_ahead_min_hit!r}"
            )
        if not self.rtt_prior_s >= 0:
            raise ValueError(f"rtt_prior_s must be >= 0, got {self.rtt_prior_s!r}")
        if self.policy.max_k != self.num_speculative_tokens:
            # One source of truth for the largest k.
            object.__setattr__(
                self, "policy", replace(self.policy, max_k=self.num_speculative_tokens)
            )


@dataclass
class _Request:
    state: RequestState
    stream: RequestStream
    arrival_s: float
    deadline_s: float | None  # on the loop's clock
    estimator: AcceptanceEstimator
    max_k: int  # this request's largest k (0: it never speculates)
    fixed_k: bool = False  # seeded under reproducible_seeds: always max_k (see the config)
    draft_worker: int | None = None
    batch_index: int = 0  # the micro-batch it joined (its draft worker group)
    last_k: int = 0  # the k of its latest round
    last_drafted_step: int = 0  # its step when it last drafted (0: never)
    target_knows: bool = False  # the target has its spec
    target_prefilled: int = 0  # context tokens the target has cached (chunked prefill)
    target_ready: bool = False  # its whole context is cached: it decodes
    draft_known: int | None = None  # committed tokens the draft worker has seen (None: unseen)
    draft_ready: bool = False  # the draft worker holds its state (prefill done)
    draft_prefill: asyncio.Future | None = None  # the prefill call in flight, if any
    step: int = 0
    cancelled: bool = False
    first_token_s: float | None = None
    last_emit_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)


@dataclass
class CoordinatorStats:
    """Totals since the last :meth:`Coordinator.reset_stats` (for benchmarks and reports)."""

    started_s: float = 0.0
    target_compute_s: float = 0.0
    target_wait_s: float = 0.0
    rounds: int = 0
    draft_bytes: int = 0
    committed_tokens: int = 0
    reused_tokens: int = 0
    draft_failures: int = 0
    dropped_blocks: int = 0
    target_prefill_s: float = 0.0  # prompt processing of requests new to the target
    target_forward_s: float = 0.0  # verification forwards alone (busy minus rules, prefill)
    target_prefill_tokens: int = 0
    prefill_chunks: int = 0  # request-rounds that only prefilled part of a prompt (chunked)
    draft_prefill_s: float = 0.0  # the same on draft workers (a separate call)
    draft_prefill_tokens: int = 0


class Coordinator:
    """Admission, continuous batching, adaptive k and pipelining over one target group.

    Use from asyncio: ``await start()``, ``stream = await submit(prompt_token_ids, params)``,
    ``async for delta in stream``, ``abort(request_id)``, ``await stop()``.
    """

    def __init__(
        self,
        target: TargetBackend,
        drafts: DraftBackend | None,
        config: CoordinatorConfig,
        *,
        vocab_size: int,
        eos_token_ids: frozenset[int] = frozenset(),
        max_positions: int | None = None,
        tokenizer=None,
        model_name: str = "default",
        request_id_prefix: str = "req-",
    ):
        self._prefix = request_id_prefix
        self.target, self.drafts, self.config = target, drafts, config
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids
        self.max_positions, self.tokenizer = max_positions, tokenizer
        self.metrics = CoordinatorMetrics(model_name)
        self.costs = Costs(config.verify_prior, config.draft_prior, config.rtt_prior_s)
        self.stats = CoordinatorStats()
        self._ids = itertools.count()
        self._group_acceptance = AcceptanceEstimator(decay=GROUP_ACCEPTANCE_DECAY)
        self._waiting: list[_Request] = []
        self._batches: list[list[_Request]] = [[] for _ in range(config.num_micro_batches)]
        self._requests: dict[str, _Request] = {}
        # One event per round loop, each cleared only by its own loop before it looks for
        # work: a shared one cleared by one loop could swallow a submit another loop needed.
        self._wakeups: list[asyncio.Event] = []
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Future] = set()  # replacements under way
        # Incremented when a worker is replaced: failures of calls to an older one are ignored.
        # Keyed by worker index: a pool may grow while serving (autoscaling).
        self._draft_generation: collections.defaultdict[int, int] = collections.defaultdict(int)
        # Requests a draft worker may still hold after it failed a call (worker -> ids).
        self._stale_drafts: collections.defaultdict[int, set[str]] = collections.defaultdict(set)
        self._rounds_off = [0] * config.num_micro_batches  # rounds in a row without drafts
        self._speculated = [False] * config.num_micro_batches  # the policy's last choice: K > 0
        self._failed_probes = [0] * config.num_micro_batches  # probes in a row that found no gain
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wakeups = [asyncio.Event() for _ in range(self.config.num_micro_batches)]
        self.stats.started_s = self._loop.time()
        self._tasks = [
            asyncio.create_task(self._run_micro_batch(index), name=f"micro-batch-{index}")
            for index in range(self.config.num_micro_batches)
        ]
        self._rtt_probe = asyncio.create_task(self._probe_rtt(), name="rtt-probe")

    async def stop(self, *, drain: bool = True) -> None:
        """Stop taking requests; finish the running ones (``drain``) or cancel them."""
        self._draining = True
        if not drain:
            for request in list(self._requests.values()):
                request.cancelled = True
        self._notify()
        await asyncio.gather(*self._tasks)
        self._rtt_probe.cancel()
        # Releases, draft prefills and worker replacements still under way: give them a
        # moment (a release frees a worker's KV cache), then cancel what is left.
        if self._background:
            _, pending = await asyncio.wait(set(self._background), timeout=STOP_GRACE_S)
            for future in pending:
                future.cancel()

    def reset_stats(self) -> None:
        self.stats = CoordinatorStats(started_s=self._loop.time())

    @property
    def num_running(self) -> int:
        return sum(len(batch) for batch in self._batches)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ---- requests ----------------------------------------------------------------------
    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout_s: float | None = None,
        num_speculative_tokens: int | None = None,
        committed_token_ids: Sequence[int] = (),
    ) -> RequestStream:
        """Admit a request or fail at once: invalid input, queue full, or draining.

        ``num_speculative_tokens`` caps this request's k below the group's (0: speculation off
        for it; None: the group's largest k). ``committed_token_ids``: output tokens already
        committed (a request resumed after a failure): they count toward ``max_tokens``, are
        not streamed again, and generation continues after them — exact, since each token is
        drawn from the target conditioned on all before it."""
        params = params or SamplingParams()
        if self._draining:
            raise UnavailableError("the coordinator is draining; retry on another replica")
        self._check_request(prompt_token_ids, params, request_id, timeout_s)
        committed = self._check_committed(committed_token_ids, params)
        max_k = self.config.num_speculative_tokens
        if num_speculative_tokens is not None:
            k = num_speculative_tokens
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise InvalidRequestError(
                    f"num_speculative_tokens must be an integer >= 0, got {k!r}",
                    param="num_speculative_tokens",
                )
            max_k = min(k, max_k)
        # Free slots count: requests submitted between two block boundaries wait for the next
        # one even when slots are free, and a burst must not be refused for that.
        free = max(self.config.max_running - self.num_running, 0)
        if len(self._waiting) >= self.config.max_queue + free:
            self.metrics.labels(self.metrics.request_rejected).inc()
            raise OverloadedError(
                f"admission queue is full ({self.config.max_queue} waiting); retry later"
            )
        request_id = request_id or f"{self._prefix}{next(self._ids)}"
        seed = params.seed if params.seed is not None else random_seed()
        state = RequestState.create(
            request_id,
            list(prompt_token_ids),
            params,
            seed,
            self.vocab_size,
            self.eos_token_ids,
        )
        state.commit(committed)  # a resumed request: what it had already committed
        now = self._loop.time()
        request = _Request(
            state=state,
            stream=RequestStream(request_id),
            arrival_s=now,
            deadline_s=now + timeout_s if timeout_s is not None else None,
            estimator=self._new_estimator(),
            max_k=max_k,
            fixed_k=self.config.reproducible_seeds and params.seed is not None and max_k > 0,
        )
        self._requests[request_id] = request
        if state.finish_reason is not None:  # resumed after its last token: only the end left
            self._end(request, None)
            return request.stream
        self._waiting.append(request)
        self.metrics.labels(self.metrics.prompt_tokens).inc(len(prompt_token_ids))
        self._update_gauges()
        self._notify()
        return request.stream

    def _new_estimator(self) -> AcceptanceEstimator:
        """A request starts from what this group's requests accepted lately, not from a fixed
        guess: one early rejection then does not switch a good draft off."""
        group_alpha = self._group_acceptance.acceptance(1)[0]
        return AcceptanceEstimator(
            prior_alpha=min(max(group_alpha, 0.05), 0.95), prior_weight=REQUEST_PRIOR_WEIGHT
        )

    def _check_request(self, prompt_token_ids, params, request_id, timeout_s) -> None:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {params!r}")
        if not prompt_token_ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        for token_id in prompt_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise InvalidRequestError(
                    f"prompt token ids must be integers, got {token_id!r}", param="prompt"
                )
            if not 0 <= token_id < self.vocab_size:
                raise InvalidRequestError(
                    f"prompt token id {token_id} is outside the vocabulary [0, {self.vocab_size})",
                    param="prompt",
                )
        try:
            params.check_vocab(self.vocab_size)
        except ValueError as error:
            raise InvalidRequestError(str(error), param=getattr(error, "param", None)) from None
        if self.max_positions and len(prompt_token_ids) + params.max_tokens > self.max_positions:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} plus the {len(prompt_token_ids)}-token prompt "
                f"exceeds the model's {self.max_positions} positions",
                param="max_tokens",
            )
        # Bounded: it is a sequence id in draft blocks and in the TP group's msgpack commands.
        if request_id is not None and (
            not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS
        ):
            raise InvalidRequestError(
                f"request_id must be a string of 1..{MAX_REQUEST_ID_CHARS} characters, got "
                f"{reprlib.repr(request_id)}",
                param="request_id",
            )
        if request_id in self._requests:
            raise InvalidRequestError(
                f"request_id {request_id!r} is already in flight", param="request_id"
            )
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise InvalidRequestError(f"timeout_s must be > 0, got {timeout_s!r}", param="timeout")

    def _check_committed(self, token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        committed = list(token_ids)
        for token_id in committed:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise InvalidRequestError(f"committed token ids must be integers, got {token_id!r}")
            if not 0 <= token_id < self.vocab_size:
                raise InvalidRequestError(
                    f"committed token id {token_id} is outside the vocabulary"
                )
        if len(committed) > params.max_tokens:
            raise InvalidRequestError(
                f"{len(committed)} committed tokens exceed max_tokens={params.max_tokens}"
            )
        return committed

    @property
    def healthy(self) -> bool:
        """Taking requests, and every round loop alive."""
        return not self._draining and all(not task.done() for task in self._tasks)

    def load_signals(self) -> dict[str, float]:
        """What autoscaling reads: queue depth, running requests, the group's acceptance and
        the share of running requests that speculated in their latest round."""
        running = [r for batch in self._batches for r in batch]
        speculating = sum(r.last_k > 0 for r in running)
        return {
            "queue_depth": float(len(self._waiting)),
            "running": float(len(running)),
            "acceptance_rate": float(self._group_acceptance.acceptance(1)[0]),
            "speculating_fraction": speculating / len(running) if running else 0.0,
        }

    def output_so_far(self, request_id: str) -> RequestOutput | None:
        """What a request in flight has committed (None once it ended): a front end that
        ends a request early (a stop string) reports this."""
        request = self._requests.get(request_id)
        return self._output(request) if request is not None else None

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its worker state is freed at its next round boundary."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        request.cancelled = True
        if request in self._waiting:
            self._waiting.remove(request)
            self._end(request, RequestCancelledError(f"request {request_id} was cancelled"))
        self._notify()
        return True

    # ---- the round loops ---------------------------------------------------------------
    async def _run_micro_batch(self, index: int) -> None:
        batch = self._batches[index]
        while True:
            self._wakeups[index].clear()  # before looking: a later submit sets it again
            try:
                self._expire_waiting()
                self._admit(index)
                self._merge_unless_split_pays(index)
                await self._reap(batch)
            except Exception:  # never let the loop die: its requests would wait forever
                log.exception("admission or release failed")
            if not batch:
                if self._draining and not self._waiting:
                    return
                if self.drafts is not None:
                    await self._release_stale_drafts()  # idle: nothing else would free them
                await self._wait_for_work(index)
                continue
            try:
                await self._round(index)
            except Exception as error:  # a target failure: fail the batch, stay up
                log.exception("round failed")
                for request in list(batch):
                    batch.remove(request)
                    self._end(request, UnavailableError(f"target group failed: {error}"))
            self._update_gauges()

    async def _probe_rtt(self) -> None:
        """Time a no-op call to the target while requests run: the network term of the policy.
        (A verify call's own latency would include queueing behind other micro-batches.)"""
        while True:
            await asyncio.sleep(RTT_PROBE_INTERVAL_S)
            if not self.num_running:
                continue
            started = self._loop.time()
            try:
                await self.target.ping()
            except Exception:  # a failing target shows up in the rounds; keep probing
                continue
            rtt_s = self._loop.time() - started
            self.costs.add_rtt(rtt_s)
            self.metrics.labels(self.metrics.network_latency).observe(rtt_s)

    def _notify(self) -> None:
        for wakeup in self._wakeups:
            wakeup.set()

    async def _wait_for_work(self, index: int) -> None:
        """Sleep until a submit, an abort or the next waiting request's deadline."""
        deadlines = [r.deadline_s for r in self._waiting if r.deadline_s is not None]
        timeout = max(min(deadlines) - self._loop.time(), 0) if deadlines else None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wakeups[index].wait(), timeout)

    def _admit(self, index: int) -> None:
        """Join waiting requests at this block boundary. While the group speculates, keep the
        micro-batches balanced (one drafts while another verifies); while it does not, the
        first takes everyone: with nothing to overlap, one large batch verifies fastest."""
        batch = self._batches[index]
        if not self._waiting or self.num_running >= self.config.max_running:
            return
        total = min(self.num_running + len(self._waiting), self.config.max_running)
        splitting = self._split_pays(total)
        if not splitting and index > 0:
            return
        while self._waiting and self.num_running < self.config.max_running:
            total = self.num_running + len(self._waiting)
            share = math.ceil(total / self.config.num_micro_batches) if splitting else total
            if len(batch) >= share:
                return
            request = self._waiting.pop(0)
            request.batch_index = index
            self._assign_draft_worker(request)
            batch.append(request)

    def _merge_unless_split_pays(self, index: int) -> None:
        """At its block boundary, a later micro-batch hands its requests to the first when a
        split no longer pays (acceptance fell, the batch shrank): the target then verifies
        them in one forward instead of two at almost the same cost each. Requests only ever
        move to the first micro-batch, so this cannot oscillate."""
        batch = self._batches[index]
        if index == 0 or not batch:
            return
        if self._split_pays(min(self.num_running + len(self._waiting), self.config.max_running)):
            return
        self._batches[0].extend(batch)
        batch.clear()
        self._wakeups[0].set()

    def _assign_draft_worker(self, request: _Request) -> None:
        """The least-loaded available draft worker of the request's micro-batch (None while
        there is none). With at least as many workers as micro-batches, micro-batch i drafts on
        the workers w with w % num_micro_batches == i: a worker's calls run one at a time, so a
        worker shared by two micro-batches drafts them in turn and the draft of one no longer
        hides behind the other's verification (a draft step on a GPU costs about the same for
        1 request as for 8)."""
        request.draft_worker = None
        if self.drafts is None or request.max_k == 0:
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

    def _expire_waiting(self) -> None:
        now = self._loop.time()
        for request in [r for r in self._waiting if r.deadline_s and r.deadline_s <= now]:
            self._waiting.remove(request)
            self._end(request, self._deadline_error(request))

    async def _reap(self, batch: list[_Request]) -> None:
        """Remove cancelled and expired requests and free their state on the workers."""
        now = self._loop.time()
        gone = [r for r in batch if r.cancelled or (r.deadline_s and r.deadline_s <= now)]
        if not gone:
            return
        for request in gone:
            batch.remove(request)
        await self._release(gone)
        for request in gone:
            error = (
                RequestCancelledError(f"request {request.state.request_id} was cancelled")
                if request.cancelled
                else self._deadline_error(request)
            )
            self._end(request, error)

    @staticmethod
    def _deadline_error(request: _Request) -> DeadlineExceededError:
        return DeadlineExceededError(
            f"request {request.state.request_id} exceeded its deadline after "
            f"{len(request.state.output_token_ids)} tokens"
        )

    async def _release(self, requests: list[_Request]) -> None:
        ids = [r.state.request_id for r in requests if r.target_knows]
        if ids:
            await self.target.release(ids)
        if self.drafts is None:
            return
        for worker in range(self.drafts.num_workers):
            ids = []
            for r in requests:
                if r.draft_worker != worker or r.draft_known is None:
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
        await self._release_stale_drafts()

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

    async def _release_stale_drafts(self) -> None:
        """Free state a draft worker kept after it failed a call and came back (only for
        requests not assigned to it again: those it prefills anew)."""
        for worker, stale in list(self._stale_drafts.items()):
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

    def _cap(self, request: _Request) -> int:
        """The largest k this request can take this round (0: it cannot speculate)."""
        cap = min(request.max_k, request.state.remaining - 1)
        # Not before the target holds its whole context (its first round prefills it: k = 0);
        # a fixed-k request is taken on by the draft worker in its first propose call.
        drafter_has_it = request.draft_ready or request.fixed_k
        if cap <= 0 or self.drafts is None or not request.target_ready or not drafter_has_it:
            return 0
        return cap if self.drafts.available(request.draft_worker) else 0

    def _choose_ks(self, index: int, requests: list[_Request]) -> list[int]:
        """k per request: the policy's (below), but a fixed-k request drafts its cap every
        round after its first (that one prefills it on the target: k = 0, whatever happens)."""
        caps = [self._cap(request) for request in requests]
        ks = self._policy_ks(index, requests, caps)
        return [cap if r.fixed_k else k for r, cap, k in zip(requests, caps, ks, strict=True)]

    def _policy_ks(self, index: int, requests: list[_Request], caps: list[int]) -> list[int]:
        """k per request: one block length for the batch (a round costs what its longest block
        costs), cut by each request's cap. When the batch has not speculated for
        ``probe_every_rounds`` rounds it probes, so that acceptance is re-measured and
        speculation comes back when it pays again."""
        if not self.config.adaptive_k:
            return caps
        ks = [0] * len(caps)
        if any(caps):
            acceptances = [
                r.estimator.acceptance(self.config.num_speculative_tokens) for r in requests
            ]
            block = choose_batch_k(
                acceptances,
                caps,
                verify=self.costs.verify,
                draft=self.costs.draft,
                rtt_s=self.costs.rtt_s,
                config=self.config.policy,
                speculating=self._speculated[index],
                **self._overlap(),
            )
            ks = [min(block, cap) for cap in caps]
        self._speculated[index] = any(ks)
        if any(ks):
            self._rounds_off[index] = self._failed_probes[index] = 0
            return ks
        self._rounds_off[index] += 1
        failed = self._failed_probes[index]
        probe_due = should_probe(self._rounds_off[index], self.config.policy, failed)
        if any(caps) and probe_due and self._could_pay(len(requests)):
            self._rounds_off[index] = 0
            self._failed_probes[index] += 1  # reset above when speculation comes back
            probe = [min(self.config.policy.probe_k, cap) for cap in caps]
            if self._group_would_speculate(len(requests)):
                return probe
            # The group's acceptance says no: re-measure it on a few scouts, the requests that
            # drafted longest ago, instead of the whole batch (at batch 16, two more verified
            # tokens for everyone cost 2.6x a step here); everyone probes once it says yes.
            able = [i for i, cap in enumerate(caps) if cap]
            scouts = sorted(able, key=lambda i: requests[i].last_drafted_step)[:SCOUT_REQUESTS]
            return [k if i in scouts else 0 for i, k in enumerate(probe)]
        return ks

    def _overlap(self, *, optimistic: bool = False) -> dict:
        """How much of a block's draft the policy may count as hidden behind target work: all
        of it while another micro-batch is there to verify meanwhile (pipelined); else, with
        draft-ahead, as much as the drafts made ahead are expected to be kept (and the rest
        overlaps the network hop: the draft worker folds the verdict in as soon as it arrives);
        else none. ``optimistic``: as if the group were split whenever it can be."""
        if optimistic:
            split = self.config.num_micro_batches > 1
        else:
            split = sum(1 for batch in self._batches if batch) > 1
        ahead = self.config.draft_ahead_min_hit if self.config.draft_ahead else None
        return {"pipelined": split, "draft_ahead_min_hit": ahead}

    def _best_k(self, acceptance: list[float], batch_size: int, *, optimistic=False) -> int:
        """The policy's k for a request with this acceptance in a batch of this size."""
        return choose_k(
            acceptance,
            batch=max(batch_size, 1),
            verify=self.costs.verify,
            draft=self.costs.draft,
            rtt_s=self.costs.rtt_s,
            config=self.config.policy,
            **self._overlap(optimistic=optimistic),
        )

    def _group_would_speculate(self, batch_size: int) -> bool:
        """Would the policy speculate at this batch size with the group's acceptance?"""
        acceptance = self._group_acceptance.acceptance(self.config.num_speculative_tokens)
        return self._best_k(acceptance, batch_size) > 0

    def _could_pay(self, batch_size: int) -> bool:
        """Would speculation pay at this batch size if every draft were accepted? If not, no
        acceptance measurement can change the answer: no probes, no micro-batch split."""
        if self.drafts is None or self.config.num_speculative_tokens == 0:
            return False
        return not self.config.adaptive_k or self._best_k([1.0], batch_size, optimistic=True) > 0

    def _split_pays(self, total: int) -> bool:
        """Split the running requests into micro-batches only when speculating on the parts
        beats verifying everyone in one batch without drafts. With one target and pipelining,
        the group's rate is one micro-batch's rate (the target alternates between them)."""
        if self.config.num_micro_batches == 1 or total < 2:
            return False
        if not self.config.adaptive_k:
            return self.drafts is not None
        if not self._could_pay(total):
            return False
        size = math.ceil(total / self.config.num_micro_batches)
        acceptance = self._group_acceptance.acceptance(self.config.num_speculative_tokens)
        split = max(
            predicted_tokens_per_s(
                acceptance,
                k,
                batch=size,
                verify=self.costs.verify,
                draft=self.costs.draft,
                rtt_s=self.costs.rtt_s,
                pipelined=True,
            )
            for k in range(1, self.config.num_speculative_tokens + 1)
        )
        single = total / self.costs.verify.seconds(max(total, 1), 1)
        return split > self.config.policy.min_gain * single

    def _prefill_grants(self, batch: list[_Request]) -> dict[str, int]:
        """request id -> context tokens the target is to have cached after this round, for
        requests it has not prefilled yet (chunked: :func:`prefill_chunks`). Those left out
        (the round's prefill budget spent) sit this round out."""
        waiting = [r for r in batch if not r.target_ready]
        if not waiting:
            return {}
        missing = [self._context(r) - r.target_prefilled for r in waiting]
        grants = prefill_chunks(missing, self.config.max_prefill_tokens_per_round)
        return {
            r.state.request_id: r.target_prefilled + grant
            for r, count, grant in zip(waiting, missing, grants, strict=True)
            if grant or not count
        }

    @staticmethod
    def _context(request: _Request) -> int:
        """Tokens the target caches before decoding: the prompt (and any committed output, as
        after a replay) but the pending token."""
        state = request.state
        return len(state.prompt_token_ids) + len(state.output_token_ids) - 1

    async def _round(self, index: int) -> None:
        batch = self._batches[index]
        self._start_draft_prefills(list(batch))
        grants = self._prefill_grants(batch)
        requests = [r for r in batch if r.target_ready or r.state.request_id in grants]
        ks = self._choose_ks(index, requests)
        target_items, draft_items = [], {}
        for request, k in zip(requests, ks, strict=True):
            request.step += 1
            request.last_k = k
            if k > 0:
                request.last_drafted_step = request.step
            state = request.state
            until = grants.get(state.request_id)
            if until is not None:
                self.stats.target_prefill_tokens += until - request.target_prefilled
            target_items.append(
                VerifyItem(
                    state.request_id,
                    request.step,
                    len(state.output_token_ids),
                    expect_draft=k > 0,
                    spec=None if request.target_knows else state.to_spec(),
                    prefill_until=until,
                )
            )
            request.target_knows = True
            if k > 0:
                draft_items.setdefault(request.draft_worker, []).append(
                    self._draft_item(request, k)
                )
        proposals = {
            (worker, self._draft_generation[worker]): asyncio.ensure_future(
                self.drafts.propose(worker, ProposeCall(tuple(items), self.config.draft_ahead))
            )
            for worker, items in draft_items.items()
        }
        reply = await self.target.verify(
            VerifyRound(tuple(target_items), self.config.draft_deadline_s)
        )
        for key, future in proposals.items():  # replies arrive in the background
            future.add_done_callback(lambda f, key=key: self._proposal_done(f, *key))
        self._record_round(reply)
        finished = []
        for request, result in zip(requests, reply.results, strict=True):
            if result.prefilling:  # a chunk of its prompt: nothing committed yet
                request.target_prefilled = grants[request.state.request_id]
                self.stats.prefill_chunks += 1
                continue
            request.target_ready = True
            self._commit(request, result)
            if request.state.finish_reason:
                finished.append(request)
        for request in finished:
            batch.remove(request)
            request.target_knows = False  # the target released it when it finished
        if finished:
            await self._release(finished)
        for request in finished:
            self._end(request, None)

    def _start_draft_prefills(self, requests: list[_Request]) -> None:
        """Hand requests the draft worker has not seen to it; they go target-only meanwhile."""
        if self.drafts is None or self.config.num_speculative_tokens == 0:
            return
        fresh: dict[int, list[_Request]] = {}
        for request in self._prefill_wanted(requests):
            if request.draft_known is None and request.max_k > 0:
                worker = request.draft_worker
                if worker is None or not self.drafts.available(worker):
                    self._assign_draft_worker(request)  # its worker left the pool, or none was
            worker = request.draft_worker
            if worker is None:
                continue
            if request.draft_known is None and self.drafts.available(worker):
                fresh.setdefault(worker, []).append(request)
        for worker, new in fresh.items():
            generation = self._draft_generation[worker]
            items = tuple(self._draft_item(request, 0) for request in new)
            future = asyncio.ensure_future(self.drafts.prefill(worker, items))
            for request in new:
                request.draft_prefill = future
            self._background.add(future)
            future.add_done_callback(self._background.discard)
            future.add_done_callback(
                lambda f, new=new, worker=worker, generation=generation: self._prefill_done(
                    f, new, worker, generation
                )
            )

    def _prefill_wanted(self, requests: list[_Request]) -> list[_Request]:
        """Requests the draft workers have not seen to hand them now: all while the batch
        would speculate; otherwise only enough for SCOUT_REQUESTS scouts, and none if
        speculation cannot pay at this batch size. A draft prefill computes beside the target
        (on a shared host it slowed the target's rounds ~10% at concurrency 16 here) and is
        wasted on a request that never drafts; the others are handed over when speculation
        comes back."""
        # (fixed-k requests are taken on by their first propose call instead)
        fresh = [r for r in requests if r.draft_known is None and not r.fixed_k]
        if not fresh:  # the usual round: nothing to decide
            return []
        if not self.config.adaptive_k or self._group_would_speculate(len(requests)):
            return fresh
        if not self._could_pay(len(requests)):
            return []
        held = len(requests) - len(fresh)
        return fresh[: max(SCOUT_REQUESTS - held, 0)]

    def _prefill_done(self, future, requests: list[_Request], worker: int, generation: int):
        if future.cancelled():  # the coordinator stopped while the draft prefilled
            return
        if future.exception() is not None:
            self._draft_failed(worker, generation, future.exception())
            return
        if generation == self._draft_generation[worker]:
            self.stats.draft_prefill_s += future.result().draft_s
            self.stats.draft_prefill_tokens += sum(
                len(r.state.prompt_token_ids) - 1 for r in requests
            )
            for request in requests:
                request.draft_ready = True

    def _draft_item(self, request: _Request, k: int) -> DraftItem:
        state = request.state
        ahead = True
        if k > 0 and self.config.draft_ahead:  # drafts before the verdict: only if kept likely
            acceptance = request.estimator.acceptance(k + 1)
            ahead = should_draft_ahead(acceptance, k, self.config.draft_ahead_min_hit)
        first_contact = request.draft_known is None
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
        return item

    def _proposal_done(self, future: asyncio.Future, worker: int, generation: int) -> None:
        try:
            reply = future.result()
        except Exception as error:  # the worker died or its call failed: replace it
            self._draft_failed(worker, generation, error)
            return
        self.stats.draft_bytes += reply.bytes
        self.stats.reused_tokens += reply.reused_tokens
        self.metrics.labels(self.metrics.wire_bytes).inc(reply.bytes)
        self.metrics.labels(self.metrics.draft_latency).observe(reply.draft_s)
        if reply.steps > 0 and reply.num_requests > 0:
            self.costs.add_draft(
                reply.num_requests, reply.draft_s / reply.steps, self.config.draft_prior
            )

    def _draft_failed(self, worker: int, generation: int, error: BaseException) -> None:
        if generation != self._draft_generation[worker]:
            return  # a call to a worker that was already replaced
        self._draft_generation[worker] += 1
        log.warning("draft worker %d failed (%s); continuing target-only", worker, error)
        self.stats.draft_failures += 1
        self.metrics.labels(self.metrics.draft_worker_restarts).inc()
        for request in self._requests.values():
            if request.draft_worker == worker:
                request.draft_known, request.draft_ready = None, False  # the new one knows none
                # If the worker was only slow it comes back holding this state: freed then.
                self._stale_drafts[worker].add(request.state.request_id)
        replacement = asyncio.ensure_future(self.drafts.replace(worker))
        self._background.add(replacement)
        replacement.add_done_callback(self._background.discard)

    def _record_round(self, reply: RoundReport) -> None:
        compute_s, wait_s = reply.compute_s, reply.wait_s
        self.stats.rounds += 1
        self.stats.target_compute_s += compute_s
        self.stats.target_wait_s += wait_s
        self.metrics.labels(self.metrics.target_busy_seconds).inc(compute_s)
        self.metrics.labels(self.metrics.pipeline_bubble_seconds).inc(wait_s)
        self.metrics.labels(self.metrics.verify_latency).observe(compute_s)
        verified = [r for r in reply.results if not r.prefilling]
        # Prefill of requests new to the target is busy time, but not the cost of a round.
        prefill_s = reply.prefill_s
        self.stats.target_forward_s += reply.forward_s
        if prefill_s > 0:
            self.stats.target_prefill_s += prefill_s
        if verified:  # (a round of prompt chunks only verifies nothing)
            widest = max(len(r.token_ids) + (r.num_draft_tokens - r.num_accepted)
                         for r in verified)  # fmt: skip
            verify_s = compute_s - prefill_s
            self.costs.add_verify(len(verified), widest, verify_s, self.config.verify_prior)
        elapsed = self._loop.time() - self.stats.started_s
        if elapsed > 0:
            busy = min(self.stats.target_compute_s / elapsed, 1.0)
            self.metrics.labels(self.metrics.target_busy_fraction).set(busy)

    def _commit(self, request: _Request, result: VerifyResult) -> None:
        state = request.state
        num_draft, num_accepted = result.num_draft_tokens, result.num_accepted
        state.metrics.record(num_draft, num_accepted)
        self.metrics.record_round(num_draft, num_accepted)
        if num_draft:
            request.estimator.update(num_draft, num_accepted)
            self._group_acceptance.update(num_draft, num_accepted)
        if result.dropped is not None:
            self.stats.dropped_blocks += 1
            reason = result.dropped.reason.value
            self.metrics.labels(self.metrics.dropped_blocks, reason=reason).inc()
        before = len(state.output_token_ids)
        state.commit(result.token_ids)
        if state.finish_reason != result.finish_reason:
            raise RuntimeError(f"coordinator and target disagree on {state.request_id}'s end")
        new = state.output_token_ids[before:]
        self.stats.committed_tokens += len(new)
        self.metrics.labels(self.metrics.generation_tokens).inc(len(new))
        now = self._loop.time()
        if request.first_token_s is None:
            request.first_token_s = now
            self.metrics.labels(self.metrics.time_to_first_token).observe(now - request.arrival_s)
        elif new:
            request.chunk_gaps_s.append(now - request.last_emit_s)
            gap = (now - request.last_emit_s) / len(new)  # the chunk's pace, per token
            inter_token = self.metrics.labels(self.metrics.inter_token_latency)
            for _ in new:
                inter_token.observe(gap)
        request.last_emit_s = now
        request.stream._push(new)

    def _end(self, request: _Request, error: SpecrayError | None) -> None:
        self._requests.pop(request.state.request_id, None)
        output = None
        if error is None:
            output = self._output(request)
            reason = output.finish_reason
            self.metrics.labels(
                self.metrics.e2e_request_latency
            ).observe(self._loop.time() - request.arrival_s)  # fmt: skip
        else:
            reason = "abort"
        self.metrics.labels(self.metrics.request_success, finished_reason=reason).inc()
        request.stream._finish(output, error)
        self._update_gauges()
        self._notify()  # a slot is free: a loop asleep with an empty batch may admit now

    def _output(self, request: _Request) -> RequestOutput:
        now = self._loop.time()
        return request.state.to_output(
            self.tokenizer,
            time_to_first_token_s=(request.first_token_s or now) - request.arrival_s,
            latency_s=now - request.arrival_s,
            chunk_gaps_s=list(request.chunk_gaps_s),
        )

    def _update_gauges(self) -> None:
        self.metrics.labels(self.metrics.num_requests_running).set(self.num_running)
        self.metrics.labels(self.metrics.num_requests_waiting).set(len(self._waiting))
