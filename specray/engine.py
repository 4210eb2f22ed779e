"""The offline engine: ``Engine(target, draft, num_speculative_tokens).generate(prompts, params)``.

One round for every active request (requests join and leave at round boundaries):
  1. the drafter proposes up to k tokens per request, each with the exact q it came from;
  2. the target runs one forward over ``[pending, d_1 .. d_n]`` per request (batched);
  3. the request's LogitsPipeline turns each row into p, with the history at that position;
  4. the verification rule (greedy or stochastic, keyed draws) commits 1..n+1 tokens;
  5. the target cache rolls back the rejected suffix; the drafter re-syncs on its next call.
The target cache holds every committed token except the last ("pending"), which is fed first.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from specray.drafters import Drafter, DraftRequest, make_drafter
from specray.models.loading import LoadedModel, load_model
from specray.models.runner import ModelRunner
from specray.outputs import RequestOutput, SpecDecodeMetrics
from specray.sampling import (
    MAX_SPEC_LEN,
    DraftProbsEncoding,
    KeyedRandom,
    LogitsPipeline,
    SamplingParams,
    VerifyUniforms,
    verify_batch,
    verify_batch_greedy,
)
from specray.sampling.rng import random_seed

DEFAULT_MAX_BATCH_SIZE = 32  # requests decoded together; more wait and join as others finish


class EngineInputError(ValueError):
    """Bad input to the engine; the message names the parameter and the value."""


@dataclass
class EngineTiming:
    """Wall time split by phase, over the engine's lifetime (for benchmarks)."""

    draft_s: float = 0.0  # drafter.propose
    target_s: float = 0.0  # target forward + pipeline + verification
    prefill_s: float = 0.0
    rounds: int = 0


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    pipeline: LogitsPipeline
    random: KeyedRandom
    stop_token_ids: frozenset[int]
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    metrics: SpecDecodeMetrics = field(default_factory=SpecDecodeMetrics)

    @property
    def pending_token(self) -> int:
        """The last committed token: known, but not yet in the target's KV cache."""
        return (self.output_token_ids or self.prompt_token_ids)[-1]

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_token_ids)

    def commit(self, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            if token_id in self.stop_token_ids:
                self.finish_reason = "stop"
                return
            if self.remaining == 0:
                self.finish_reason = "length"
                return


def _eos_token_ids(model: torch.nn.Module, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (config_eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(value)
    return frozenset(ids)


class Engine:
    """Speculative decoding in one process, exact under every sampling option.

    target: ``"default"`` (bundled SmolLM2-135M-Instruct), a model directory, a ``.gguf`` file,
        or an in-memory ``torch.nn.Module`` causal LM (then pass ``tokenizer`` or use token ids).
    draft: ``None`` (target-only), ``"ngram"`` (prompt lookup), ``"default"`` (currently the
        target's own weights in bf16, ``"self:bf16"``), ``"self:fp32"`` / ``"self:fp16"``, a
        model directory / ``.gguf`` sharing the target's tokenizer, or an in-memory module.
    num_speculative_tokens: k, the most draft tokens verified per round (0..MAX_SPEC_LEN).
    draft_probs_encoding: how q is represented (fp32 | fp16 | bf16 | top<M>); the draft samples
        from the encoded q, so every choice is exact.
    """

    def __init__(
        self,
        target: str | torch.nn.Module = "default",
        draft: str | torch.nn.Module | Drafter | None = None,
        num_speculative_tokens: int = 4,
        *,
        draft_probs_encoding: str = "fp32",
        tokenizer=None,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    ):
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int):
            raise EngineInputError(
                f"num_speculative_tokens must be an integer, got {num_speculative_tokens!r}"
            )
        if not 0 <= num_speculative_tokens <= MAX_SPEC_LEN:
            raise EngineInputError(
                f"num_speculative_tokens must be in [0, {MAX_SPEC_LEN}], "
                f"got {num_speculative_tokens}"
            )
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int):
            raise EngineInputError(f"max_batch_size must be an integer, got {max_batch_size!r}")
        if max_batch_size < 1:
            raise EngineInputError(f"max_batch_size must be >= 1, got {max_batch_size}")
        encoding = DraftProbsEncoding.parse(draft_probs_encoding)
        if isinstance(target, str):
            loaded = load_model(target, param="target")
        elif isinstance(target, torch.nn.Module):
            loaded = LoadedModel(target.eval(), tokenizer, path=None)
        else:
            raise EngineInputError(f"target must be a string or a model, got {target!r}")
        self.tokenizer = loaded.tokenizer
        self.target = ModelRunner(loaded.model)
        self.vocab_size = self.target.vocab_size
        self.max_positions = getattr(loaded.model.config, "max_position_embeddings", None)
        self.eos_token_ids = _eos_token_ids(loaded.model, self.tokenizer)
        if isinstance(draft, torch.nn.Module):
            from specray.drafters import ModelDrafter, check_same_vocabulary

            runner = ModelRunner(draft)
            check_same_vocabulary(None, None, self.vocab_size, runner.vocab_size)
            self.drafter = ModelDrafter(runner, encoding)
        elif draft is None or isinstance(draft, str):
            self.drafter = make_drafter(draft, loaded, self.vocab_size, encoding)
        else:
            self.drafter = draft
        self.num_speculative_tokens = num_speculative_tokens if self.drafter else 0
        self.max_batch_size = max_batch_size
        self.timing = EngineTiming()
        self._ids = itertools.count()

    # ---- inputs ------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int], *, use_chat_template: bool = True):
        """Text (chat template applied when the tokenizer has one) or token ids -> token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise EngineInputError("prompt text needs a tokenizer; pass token ids instead")
            if use_chat_template and getattr(self.tokenizer, "chat_template", None):
                encoded = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}],
                    add_generation_prompt=True,
                    tokenize=True,
                )
                if hasattr(encoded, "keys"):
                    encoded = encoded["input_ids"]
                return list(encoded)
            return list(self.tokenizer.encode(prompt))
        token_ids = list(prompt)
        for token_id in token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise EngineInputError(f"prompt token ids must be integers, got {token_id!r}")
            if not 0 <= token_id < self.vocab_size:
                raise EngineInputError(
                    f"prompt token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
                )
        return token_ids

    def _make_request(self, index: int, prompt, params: SamplingParams, use_chat_template: bool):
        if not isinstance(params, SamplingParams):
            raise EngineInputError(f"params must be SamplingParams, got {params!r}")
        token_ids = self.encode_prompt(prompt, use_chat_template=use_chat_template)
        if not token_ids:
            raise EngineInputError(f"prompts[{index}] is empty")
        if self.max_positions and len(token_ids) + params.max_tokens > self.max_positions:
            raise EngineInputError(
                f"max_tokens={params.max_tokens} plus the {len(token_ids)}-token prompt exceeds "
                f"the model's {self.max_positions} positions"
            )
        seed = params.seed if params.seed is not None else random_seed()
        stop = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop |= self.eos_token_ids
        return _Request(
            request_id=f"req-{next(self._ids)}",
            prompt_token_ids=token_ids,
            params=params,
            pipeline=LogitsPipeline(params, self.vocab_size, token_ids),
            random=KeyedRandom(seed),
            stop_token_ids=frozenset(stop),
        )

    # ---- generation --------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_chat_template: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids), batched; one output per prompt."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise EngineInputError(
                f"params must be one SamplingParams or one per prompt ({len(prompts)}), "
                f"got {len(params)}"
            )
        requests = [
            self._make_request(index, prompt, request_params, use_chat_template)
            for index, (prompt, request_params) in enumerate(zip(prompts, params, strict=True))
        ]
        waiting, active = list(requests), []
        try:
            while waiting or active:
                admitted = waiting[: self.max_batch_size - len(active)]
                del waiting[: len(admitted)]
                if admitted:
                    self._prefill(admitted)
                    active.extend(admitted)
                self._round(active)
                finished = [request for request in active if request.finish_reason]
                if finished:
                    self._release([request.request_id for request in finished])
                    active = [request for request in active if not request.finish_reason]
        finally:
            self._release([request.request_id for request in active])
        return [self._output(request) for request in requests]

    def _release(self, request_ids: list[Hashable]) -> None:
        self.target.remove(request_ids)
        if self.drafter is not None:
            self.drafter.release(request_ids)

    def _prefill(self, requests: list[_Request]) -> None:
        started = time.perf_counter()
        feeds = {r.request_id: r.prompt_token_ids[:-1] for r in requests}
        self.target.forward({key: value for key, value in feeds.items() if value}, {})
        self.timing.prefill_s += time.perf_counter() - started

    def _round(self, requests: list[_Request]) -> None:
        started = time.perf_counter()
        blocks = self._draft(requests)
        drafted = time.perf_counter()
        feeds = {r.request_id: [r.pending_token, *blocks[r.request_id][0]] for r in requests}
        logits = self.target.forward(feeds, {key: len(value) for key, value in feeds.items()})
        target_probs = [
            r.pipeline.probs(logits[r.request_id], r.output_token_ids, blocks[r.request_id][0])
            for r in requests
        ]  # each [n + 1, vocab]
        results = self._verify(requests, blocks, target_probs)
        for request, committed in zip(requests, results, strict=True):
            num_draft = len(blocks[request.request_id][0])
            num_accepted = len(committed) - 1
            request.metrics.record(num_draft, num_accepted)
            request.commit(committed)
            # The cache got [pending, d_1..d_n]; keep pending and the accepted drafts.
            self.target.rollback(request.request_id, num_draft - num_accepted)
        self.timing.draft_s += drafted - started
        self.timing.target_s += time.perf_counter() - drafted
        self.timing.rounds += 1

    def _draft(self, requests: list[_Request]) -> dict[Hashable, tuple[list[int], torch.Tensor]]:
        empty = ([], torch.zeros(0, self.vocab_size))
        blocks = {r.request_id: empty for r in requests}
        asks = []
        for request in requests:
            k = min(self.num_speculative_tokens, request.remaining - 1)
            if k > 0:
                asks.append(
                    DraftRequest(
                        request.request_id,
                        request.prompt_token_ids,
                        request.output_token_ids,
                        request.pipeline,
                        request.random,
                        k,
                    )
                )
        if asks:
            for ask, block in zip(asks, self.drafter.propose(asks), strict=True):
                if len(block.token_ids) > ask.num_tokens:
                    raise RuntimeError(
                        f"drafter proposed {len(block.token_ids)} tokens, asked {ask.num_tokens}"
                    )
                blocks[ask.request_id] = (block.token_ids, block.draft_probs)
        return blocks

    def _verify(self, requests, blocks, target_probs) -> list[list[int]]:
        """Apply each request's rule; greedy and sampled requests are batched separately."""
        committed: list[list[int]] = [[] for _ in requests]
        for greedy in (True, False):
            rows = [i for i, r in enumerate(requests) if r.params.greedy == greedy]
            if not rows:
                continue
            k = max(len(blocks[requests[i].request_id][0]) for i in rows)
            num_draft = torch.tensor([len(blocks[requests[i].request_id][0]) for i in rows])
            draft_ids = torch.zeros(len(rows), k, dtype=torch.int64)  # [batch, k]
            padded_target = torch.zeros(len(rows), k + 1, self.vocab_size)  # [batch, k+1, vocab]
            padded_draft = torch.zeros(len(rows), k, self.vocab_size)  # [batch, k, vocab]
            accept = torch.zeros(len(rows), k, dtype=torch.float64)  # [batch, k]
            residual = torch.zeros(len(rows), k, dtype=torch.float64)  # [batch, k]
            bonus = torch.zeros(len(rows), dtype=torch.float64)  # [batch]
            for slot, i in enumerate(rows):
                tokens, draft_probs = blocks[requests[i].request_id]
                n = len(tokens)
                draft_ids[slot, :n] = torch.tensor(tokens, dtype=torch.int64)
                padded_target[slot, : n + 1] = target_probs[i]
                if greedy:
                    continue
                padded_draft[slot, :n] = draft_probs
                uniforms = VerifyUniforms.draw(
                    requests[i].random, n, len(requests[i].output_token_ids)
                )
                accept[slot, :n], residual[slot, :n] = uniforms.accept[0], uniforms.residual[0]
                bonus[slot] = uniforms.bonus[0]
            if greedy:
                result = verify_batch_greedy(draft_ids, num_draft, padded_target)
            else:
                result = verify_batch(
                    draft_ids,
                    num_draft,
                    padded_draft,
                    padded_target,
                    VerifyUniforms(accept, residual, bonus),
                )
            for slot, i in enumerate(rows):
                committed[i] = result.row(slot).token_ids.tolist()
        return committed

    def _output(self, request: _Request) -> RequestOutput:
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=text,
            finish_reason=request.finish_reason or "length",
            seed=request.random.seed,
            metrics=request.metrics,
        )
