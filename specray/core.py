"""Target-side core shared by every backend: request state and one verification round.

The in-process :class:`specray.engine.Engine` drives it with a local drafter; the distributed
target worker drives it with draft blocks that arrived over gRPC. Either way a round is:
  1. one target forward over ``[pending, d_1 .. d_n]`` per request (batched);
  2. the requests' LogitsPipelines turn each row into p, with the history at that position
     (all requests in one batched pass, bit-identical to each pipeline's own);
  3. the verification rule (greedy or stochastic, keyed draws) commits 1..n+1 tokens;
  4. the target cache rolls back the rejected suffix.
The target cache holds every committed token except the last ("pending"), which is fed first.
A request new to the target caches its context in the round's forward too, before its pending
token (``fused``: one forward for the round, not a prefill forward beside it), unless it scores
its prompt, takes a chunk of it, or the draft reads target features (:meth:`TargetCore.fusable`).

With ``keep_features`` (a feature-conditioned drafter) the core also keeps, per request, the
target's final-norm hidden state h_i of every committed position in its cache: prefill gives
h_0 .. h_{P-2}, each round the rows of pending and the accepted drafts (the rows it keeps).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from specray.feature_rows import FeatureRows
from specray.models.device import DeviceTimer
from specray.models.runner import ModelRunner
from specray.outputs import RequestOutput, SpecDecodeMetrics
from specray.protocol import RequestSpec
from specray.sampling import (
    KeyedRandom,
    LogitsPipeline,
    SamplingParams,
    VerifyUniforms,
    greedy_committed,
)
from specray.sampling.batch_pipeline import BatchLogitsPipeline
from specray.sampling.grammar import Grammars
from specray.sampling.logprobs import TokenLogprob, scored_rows, unpack
from specray.sampling.rng import seed_tensor
from specray.sampling.rows import Workspace, memory_order
from specray.sampling.verify_sparse import DraftProbs, verify_blocks
from specray.target_rounds import prefill_span


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    pipeline: LogitsPipeline
    random: KeyedRandom
    stop_token_ids: frozenset[int]
    output_token_ids: list[int] = field(default_factory=list)
    # "stop" / "length"; "error" with ``error`` saying why (nothing after it is committed)
    finish_reason: str | None = None
    error: str | None = None
    metrics: SpecDecodeMetrics = field(default_factory=SpecDecodeMetrics)
    # With params.logprobs: one per output token. With params.prompt_logprobs: prompt
    # positions 1 .. len(prompt) - 1 as far as they are cached (position 0 has none).
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @staticmethod
    def create(
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        grammars: Callable[[], Grammars] | None = None,
    ) -> RequestState:
        """``grammars``: this process's grammar compiler (built on first use), for requests
        with structured outputs."""
        stop = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop |= eos_token_ids
        return RequestState(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            # min_tokens masks what would end the request: these ids
            pipeline=LogitsPipeline(
                params,
                vocab_size,
                prompt_token_ids,
                sorted(stop),
                grammars() if grammars is not None and params.structured_outputs else None,
            ),
            random=KeyedRandom(seed),
            stop_token_ids=frozenset(stop),
        )

    @staticmethod
    def from_spec(
        spec: RequestSpec,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        grammars: Callable[[], Grammars] | None = None,
    ) -> RequestState:
        """Rebuild a request on a worker from its spec (see :meth:`to_spec`)."""
        state = RequestState.create(
            spec.request_id,
            list(spec.prompt_token_ids),
            spec.params,
            spec.seed,
            vocab_size,
            eos_token_ids,
            grammars,
        )
        state.output_token_ids = list(spec.output_token_ids)
        return state

    def to_spec(self, *, with_output: bool = True) -> RequestSpec:
        """What a worker needs to hold this request (its committed output unless told not)."""
        return RequestSpec(
            self.request_id,
            tuple(self.prompt_token_ids),
            self.params,
            self.random.seed,
            tuple(self.output_token_ids) if with_output else (),
        )

    def to_output(self, tokenizer=None, **timing) -> RequestOutput:
        """The caller's view of this request; ``timing``: the served latency fields."""
        text = ""
        if tokenizer is not None:
            text = tokenizer.decode(self.output_token_ids, skip_special_tokens=True)
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.output_token_ids),
            text=text,
            finish_reason=self.finish_reason or "length",
            seed=self.random.seed,
            metrics=self.metrics,
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
            prompt_logprobs=(
                [None, *self.prompt_logprobs] if self.params.prompt_logprobs is not None else None
            ),
            **timing,
        )

    @property
    def pending_token(self) -> int:
        """The last committed token: known, but not yet in the target's KV cache."""
        return (self.output_token_ids or self.prompt_token_ids)[-1]

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_token_ids)

    def commit_verified(self, token_ids: list[int]) -> list[int]:
        """Commit ``token_ids``, drawn from rows 0.. of this request's last verification, up
        to the row where its grammar allows no token (:attr:`GrammarMatcher.dead_end`): a token
        drawn there would break the grammar, so the request ends with an error instead.
        Returns the tokens given to :meth:`commit`."""
        grammar = self.pipeline.grammar
        dead_end = grammar.dead_end if grammar is not None else None
        if dead_end is None or len(token_ids) <= dead_end:
            self.commit(token_ids)
            return token_ids
        kept = token_ids[:dead_end]
        error = (
            f"structured_outputs: after {len(self.output_token_ids) + len(kept)} output tokens"
            " the grammar allows no token of this model's vocabulary"
        )
        self.commit(kept, error=error)
        return kept

    def commit(self, token_ids: Sequence[int], *, error: str | None = None) -> None:
        """Append ``token_ids`` (up to a stop token or the length); ``error``: then the request
        ends with finish_reason "error" unless it ended on its own."""
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            if token_id in self.stop_token_ids:
                self.finish_reason = "stop"
                return
            if self.remaining == 0:
                self.finish_reason = "length"
                return
        if error is not None:
            self.finish_reason, self.error = "error", error


def eos_token_ids(model: torch.nn.Module, tokenizer) -> frozenset[int]:
    """End-of-sequence ids from the model's generation config and the tokenizer."""
    ids: set[int] = set()
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (config_eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(value)
    return frozenset(ids)


# A block as the core consumes it: drafted tokens [n] and the exact q they came from, dense
# [n, vocab] or, as a top<M> block arrives, sparse [n, M].
Block = tuple[list[int], DraftProbs]


class TargetCore:
    """Owns the target runner; verifies blocks and commits tokens into request states."""

    def __init__(self, runner: ModelRunner, *, keep_features: bool = False):
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.keep_features = keep_features
        self.hidden_size = int(runner.model.config.hidden_size) if keep_features else 0
        self._features: dict[Hashable, FeatureRows] = {}  # h of committed cached positions
        self.prefilling: set[Hashable] = set()  # requests whose cache stops short of the prompt
        self.forward_s = 0.0  # seconds in verification forwards (the rest of a round is rules)
        self._batch_pipeline = BatchLogitsPipeline()  # every request's p in one pass per round
        self._rules_workspace = Workspace()  # the rules' final rows, reused

    def prefill(
        self, requests: Sequence[RequestState], until: Mapping[Hashable, int | None] | None = None
    ) -> set[Hashable]:
        """Cache each prompt except its last token (the first pending token), going on from
        what is cached already; with ``until``, only up to that many of a request's tokens
        (chunked prefill: a long prompt over several rounds, beside other requests' decoding).
        Returns the requests whose cache still stops short (also kept in ``prefilling``).
        """
        feeds, starts, short, scored = {}, {}, set(), {}
        for request in requests:
            seq_id = request.request_id
            cached = self.runner.length(seq_id) if seq_id in self.runner else 0
            grant = until.get(seq_id) if until is not None else None
            end, still_short = prefill_span(cached, len(request.prompt_token_ids) - 1, grant)
            if end > cached:
                feeds[seq_id], starts[seq_id] = request.prompt_token_ids[cached:end], cached
                if request.params.prompt_logprobs is not None and not request.output_token_ids:
                    scored[seq_id] = request  # (a replayed request's are delivered already)
            if still_short:
                short.add(seq_id)
        self.prefilling.difference_update(request.request_id for request in requests)
        self.prefilling |= short
        sizes = {seq_id: len(feeds[seq_id]) for seq_id in scored}  # logits of every position
        if not self.keep_features:
            logits = self.runner.forward(feeds, sizes)
            self._score_prompts(scored, starts, logits)
            return short
        logits, hidden = self.runner.forward(
            feeds, sizes, num_hidden={k: len(v) for k, v in feeds.items()}
        )
        self._score_prompts(scored, starts, logits)
        for request in requests:
            if request.request_id not in self._features:
                self._features[request.request_id] = FeatureRows(self.hidden_size)
            if request.request_id in hidden:
                self._features[request.request_id].write(
                    starts[request.request_id], hidden[request.request_id]
                )
        return short

    @staticmethod
    def _score_prompts(scored, starts, logits) -> None:
        """Prompt positions ``s+1 .. e`` of each scored request from its chunk's logits, read
        to the host in one copy."""
        if not scored:
            return
        width = max(request.params.prompt_logprobs for request in scored.values())
        parts, predicted = [], {}
        for seq_id, request in scored.items():
            rows = logits[seq_id]  # [e - s, vocab]: position s + i predicts prompt[s + i + 1]
            start = starts[seq_id]
            predicted[seq_id] = request.prompt_token_ids[start + 1 : start + 1 + rows.shape[0]]
            ids = torch.tensor(predicted[seq_id], dtype=torch.int64, device="cpu")
            parts.append(scored_rows(rows, ids.to(rows.device), width))
        host = iter(torch.cat(parts).tolist())
        for seq_id, request in scored.items():
            tokens = predicted[seq_id]
            top = [request.params.prompt_logprobs] * len(tokens)
            del request.prompt_logprobs[starts[seq_id] :]  # a chunk cached again replaces its own
            request.prompt_logprobs.extend(
                unpack(list(itertools.islice(host, len(tokens))), tokens, top)
            )

    def target_features(self, request_id: Hashable) -> torch.Tensor:
        """h_0 .. h_{T-2} of a request with T committed tokens: ``[T - 1, hidden]`` (a view)."""
        return self._features[request_id].view()

    def release(self, request_ids: Sequence[Hashable]) -> None:
        self.runner.remove(request_ids)
        self.prefilling.difference_update(request_ids)
        for request_id in request_ids:
            self._features.pop(request_id, None)

    def fusable(
        self, requests: Sequence[RequestState], until: Mapping[Hashable, int | None]
    ) -> dict[Hashable, list[int]]:
        """Of ``requests`` (new here, or cached short of their context), those whose context
        the round's verification forward can cache before their pending token, with the
        tokens each still lacks: one packed forward for the round instead of a prefill forward
        beside it. Not a request that scores its prompt (prompt logprobs read every
        position's logits), one granted a chunk short of its context (``until``), nor any
        when the draft reads target features (every position's hidden state is kept). They
        leave ``prefilling``: :meth:`verify_round` caches the rest of their context."""
        if self.keep_features:
            return {}
        fused = {}
        for request in requests:
            seq_id, params = request.request_id, request.params
            context = [*request.prompt_token_ids, *request.output_token_ids][:-1]
            grant = until.get(seq_id)
            if params.prompt_logprobs is not None or (grant is not None and grant < len(context)):
                continue
            cached = self.runner.length(seq_id) if seq_id in self.runner else 0
            fused[seq_id] = context[cached:]
            self.prefilling.discard(seq_id)
        return fused

    def verify_round(
        self,
        requests: Sequence[RequestState],
        blocks: Mapping[Hashable, Block],
        uncached: Mapping[Hashable, Sequence[int]] | None = None,
    ) -> list[list[int]]:
        """One round for ``requests``; ``blocks`` lacks requests that run target-only;
        ``uncached``: the context tokens a request still lacks in the cache (:meth:`fusable`),
        fed before its pending token in the same forward.

        Commits the tokens into each request (stop and length applied), records metrics and
        rolls the cache back to the accepted prefix. Returns the committed tokens per request.
        """
        empty: Block = ([], torch.zeros(0, self.vocab_size, device=self.runner.device))
        blocks = {r.request_id: blocks.get(r.request_id, empty) for r in requests}
        uncached = uncached or {}
        # Logits (and hidden states) of [pending, d_1 .. d_n]: the trailing rows of each feed.
        sizes = {r.request_id: 1 + len(blocks[r.request_id][0]) for r in requests}
        feeds = {}
        for r in requests:
            feeds[r.request_id] = [
                *uncached.get(r.request_id, ()),
                r.pending_token,
                *blocks[r.request_id][0],
            ]
        hidden = {}  # request -> h of [pending, d_1 .. d_n]: [n + 1, hidden]
        timer = DeviceTimer(self.runner.device).start()
        if self.keep_features:
            logits, hidden = self.runner.forward(feeds, sizes, num_hidden=sizes)
        else:
            logits = self.runner.forward(feeds, sizes)
        timer.stop()
        # In the order the forward left their rows (the cache's, not the round's once rows were
        # refilled): the batched passes then read the logits in place, no [R, vocab] copy.
        taken = requests
        requests = [requests[i] for i in memory_order([logits[r.request_id] for r in requests])]
        # Greedy: the argmax ids [n + 1]; sampled: the distributions [n + 1, vocab].
        target_rows = self._batch_pipeline(
            [r.pipeline for r in requests],
            [logits[r.request_id] for r in requests],
            [r.output_token_ids for r in requests],
            [blocks[r.request_id][0] for r in requests],
        )
        results = self._verify(requests, blocks, target_rows)
        self.forward_s += timer.seconds()  # the results' copy waited for the device already
        before = [len(request.output_token_ids) for request in requests]
        for index, (request, committed) in enumerate(zip(requests, results, strict=True)):
            num_draft = len(blocks[request.request_id][0])
            num_accepted = len(committed) - 1
            request.metrics.record(num_draft, num_accepted)
            results[index] = request.commit_verified(committed)
            # The cache got [pending, d_1..d_n]; keep pending and the accepted drafts.
            self.runner.rollback(request.request_id, num_draft - num_accepted)
            if self.keep_features:  # and their h: the committed positions now cached
                store = self._features[request.request_id]
                store.write(len(store), hidden[request.request_id][: num_accepted + 1])
        self._score_outputs(requests, before, logits, target_rows)
        by_request = {r.request_id: tokens for r, tokens in zip(requests, results, strict=True)}
        return [by_request[r.request_id] for r in taken]

    @staticmethod
    def _score_outputs(requests, before, logits, target_rows) -> None:
        """Log-probabilities of the tokens each asking request committed this round, from its
        rows of this round (row j: output position ``before + j``), read in one copy."""
        asking = [
            (request, start, rows)
            for request, start, rows in zip(requests, before, target_rows, strict=True)
            if request.params.logprobs is not None and len(request.output_token_ids) > start
        ]
        if not asking:
            return
        width = max(request.params.logprobs for request, _, _ in asking)
        device = logits[asking[0][0].request_id].device
        token_ids = [t for request, start, _ in asking for t in request.output_token_ids[start:]]
        ids = torch.tensor(token_ids, dtype=torch.int64, device="cpu").to(device)  # [m]
        parts, offset = [], 0
        for request, start, rows in asking:
            params, tokens = request.params, request.output_token_ids[start:]
            raw = logits[request.request_id][: len(tokens)]  # [count, vocab]
            own = ids[offset : offset + len(tokens)]
            offset += len(tokens)
            if params.logprobs_mode == "raw":
                parts.append(scored_rows(raw, own, width))
            elif params.greedy:  # drawn as the argmax of the processed logits
                history = request.output_token_ids[:start]
                processed = request.pipeline.processed_logits(raw, history, tokens)
                parts.append(scored_rows(processed, own, width))
            else:  # the pipeline's distribution rows
                parts.append(scored_rows(rows[: len(tokens)], own, width, probs=True))
        host = torch.cat(parts).tolist()  # [m, 2 + 2 * width]: the round's one extra copy
        num_top = [
            request.params.logprobs
            for request, start, _ in asking
            for _ in request.output_token_ids[start:]
        ]
        entries = iter(unpack(host, token_ids, num_top))
        for request, start, _ in asking:
            request.logprobs.extend(
                itertools.islice(entries, len(request.output_token_ids) - start)
            )

    def _verify(self, requests, blocks, target_rows) -> list[list[int]]:
        """Apply each request's rule. ``target_rows``: per request, its argmax ids ``[n + 1]``
        when greedy, else its distributions ``[n + 1, vocab]``. Sampled requests' rule runs on
        the device, batched; greedy requests' on the host (:func:`greedy_committed`), from
        their argmax ids, which ride in the round's one copy to the host with the sampled
        results: the committed tokens end there anyway, and a few comparisons per request cost
        less than the dozen kernels of the batched greedy rule (docs/bench/history.md)."""
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        to_host = [target_rows[i] for i in greedy]  # [n_i + 1] int64 each
        width = 0  # of a sampled row on the host: its accepted count, then k + 1 tokens
        if sampled:
            result = self._verify_sampled(
                [requests[i] for i in sampled], blocks, [target_rows[i] for i in sampled]
            )
            width = 1 + result.token_ids.shape[1]
            packed = torch.cat([result.num_accepted[:, None], result.token_ids], dim=1)
            to_host.append(packed.flatten())  # [batch * width]
        host = torch.cat(to_host).tolist() if to_host else []  # the round's one copy
        committed: list[list[int]] = [[] for _ in requests]
        offset = 0
        for i in greedy:
            drafted = blocks[requests[i].request_id][0]
            ids = host[offset : offset + len(drafted) + 1]
            committed[i] = greedy_committed(drafted, ids)
            offset += len(ids)
        for i in sampled:
            row = host[offset : offset + width]
            committed[i] = row[1 : row[0] + 2]
            offset += width
        return committed

    def _verify_sampled(self, requests, blocks, target_probs):
        """The sampled requests' rule, batched on the target rows' device: a whole round's
        keyed draws at once; q as the blocks carry it (a top<M> q stays sparse). Blocks from
        draft workers were checked at the boundary (check_block), so the rules trust them and
        read one flag on the host."""
        device = self.runner.device
        drafted = [blocks[request.request_id][0] for request in requests]
        k = max(len(tokens) for tokens in drafted)
        # Built on the host from the blocks, then one copy each to the device.
        num_draft = torch.tensor([len(tokens) for tokens in drafted], device="cpu")
        draft_ids = torch.zeros(len(requests), k, dtype=torch.int64, device="cpu")  # [batch, k]
        for slot, tokens in enumerate(drafted):
            draft_ids[slot, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64, device="cpu")
        num_draft, draft_ids = num_draft.to(device), draft_ids.to(device)
        seeds = seed_tensor([request.random.seed for request in requests], device)
        first = torch.tensor([len(r.output_token_ids) for r in requests], device=device)
        uniforms = VerifyUniforms.draw_round(seeds, first, num_draft, draft_ids.shape[1], device)
        draft_probs = [blocks[request.request_id][1] for request in requests]
        return verify_blocks(
            draft_ids,
            num_draft,
            draft_probs,
            target_probs,
            uniforms,
            validate=False,
            workspace=self._rules_workspace,
        )
