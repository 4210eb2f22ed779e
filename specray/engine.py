"""The offline engine: ``Engine(target, draft, num_speculative_tokens).generate(prompts, params)``.

Each round, for every active request (requests join and leave at round boundaries), the drafter
proposes up to k tokens with the exact q each came from, and the target core verifies them all
in one batched forward (see :mod:`specray.core`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import torch

from specray.cluster.distributed import DistributedBackend, connect
from specray.cluster.placement import PlacementConfig, check_draft_placement
from specray.core import Block, RequestState, TargetCore, eos_token_ids
from specray.drafters import Drafter, DraftRequest, make_drafter
from specray.engine_core.admission import check_structured_outputs
from specray.engine_core.client import EngineCoreClient
from specray.engine_core.coordinator_config import (
    DEFAULT_DRAFT_DEADLINE_S,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    CoordinatorConfig,
)
from specray.errors import InvalidRequestError
from specray.models.device import DeviceError, check_device_spec, check_dtype_spec, resolve_device
from specray.models.loading import LoadedModel, load_model, load_model_info
from specray.models.runner import ModelRunner
from specray.outputs import RequestOutput
from specray.prompts import prompt_token_ids
from specray.sampling import (
    MAX_SPEC_LEN,
    DraftProbsEncoding,
    SamplingParams,
    SamplingParamsError,
)
from specray.sampling.grammar import lazy_grammars
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


class Engine:
    """Speculative decoding in one process, exact under every sampling option.

    target: ``"default"`` (bundled SmolLM2-135M-Instruct), a model directory, a ``.gguf`` file,
        or an in-memory ``torch.nn.Module`` causal LM (then pass ``tokenizer`` or use token ids).
    draft: ``None`` (target-only), ``"ngram"`` (prompt lookup), ``"self:auto"`` /
        ``"self:bf16"`` / ``"self:fp16"`` / ``"self:fp32"`` / ``"self:int8"`` (the target's own
        weights, cheaper), ``"distilled"`` / ``"distilled:fp32|fp16|bf16"`` (the draft shipped
        for the default target), a ``specray distill`` output directory (a feature-conditioned
        one reads the target's hidden states), a model directory / ``.gguf`` sharing the
        target's tokenizer, ``"ngram+<any model draft>"`` (prompt lookup first), ``"default"``
        / ``"auto"`` (the winner ``specray bench --drafters all --record`` measured for this
        target; ``self:auto`` for a target never measured), or an in-memory module.
    num_speculative_tokens: k, the most draft tokens verified per round (0..MAX_SPEC_LEN).
    draft_probs_encoding: how q is represented (fp32 | fp16 | bf16 | top<M>); the draft samples
        from the encoded q, so every choice is exact.
    cluster: ``None`` runs in this process; ``"auto"`` runs draft and target as Ray actors that
        exchange blocks over gRPC on an embedded local Ray; an address joins an existing cluster.
    tp_size: tensor-parallel ranks of the target group (distributed only).
    num_draft_workers / draft_placement (distributed only): ``"workers"``, that many draft
        actors on draft nodes, each streaming to the target over gRPC; ``"colocated"``, one
        draft inside the target group's rank 0, beside the engine core (no hop per round);
        ``"auto"``, colocated for a draft small beside its target (prompt lookup, a distilled
        draft) unless several workers are asked for, else workers
        (:func:`specray.cluster.placement.resolve_draft_placement`).
    coordinator: scheduling of the distributed path (micro-batches, adaptive k, draft-ahead);
        by default plain rounds with a fixed k, like the in-process engine (seeded requests
        draft every round after their first: ``reproducible_seeds``).
    device: ``"auto"`` (a GPU when this process sees one, else the CPU), ``"cpu"``, ``"cuda"``
        or ``"cuda:N"``; an unavailable device fails here, naming it. Distributed workers take
        the GPUs Ray gives them. ``dtype``: ``"auto"`` (bfloat16 on CUDA, float32 on the CPU),
        ``"float32"``, ``"bfloat16"`` or ``"float16"``, for the target loaded from files.
    batch_invariant: the target computes each token's logits bitwise the same whatever else
        its forward holds (one token or a verified block, alone or in a batch): outputs and
        log-probabilities are then identical with and without speculation; slower
        (specray/models/batch_invariant.py).
    """

    def __init__(
        self,
        target: str | torch.nn.Module = "default",
        draft: str | torch.nn.Module | Drafter | None = None,
        num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
        *,
        draft_probs_encoding: str = "fp32",
        tokenizer=None,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        cluster: str | None = None,
        tp_size: int = 1,
        placement: PlacementConfig | None = None,
        draft_deadline_s: float = DEFAULT_DRAFT_DEADLINE_S,
        num_draft_workers: int = 1,
        draft_placement: str = "auto",
        coordinator: CoordinatorConfig | None = None,
        device: str = "auto",
        dtype: str = "auto",
        batch_invariant: bool = False,
    ):
        try:
            check_device_spec(device)
            check_dtype_spec(dtype)
        except DeviceError as error:
            raise EngineInputError(str(error)) from None
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
        try:
            check_draft_placement(draft_placement)
        except ValueError as error:
            raise EngineInputError(str(error)) from None
        if not isinstance(batch_invariant, bool):
            raise EngineInputError(
                f"batch_invariant must be True or False, got {batch_invariant!r}"
            )
        encoding = DraftProbsEncoding.parse(draft_probs_encoding)
        self.max_batch_size = max_batch_size
        self.timing = EngineTiming()
        self._ids = itertools.count()
        self.backend: DistributedBackend | None = None
        self.runner: EngineCoreClient | None = None
        if cluster is not None:
            config = coordinator or CoordinatorConfig(
                max_running=max_batch_size,
                max_queue=1 << 20,  # generate() submits every prompt at once
                num_micro_batches=1,
                num_speculative_tokens=num_speculative_tokens,
                adaptive_k=False,
                draft_ahead=False,
                draft_deadline_s=draft_deadline_s,
                # As in process: a seeded request drafts every round after its first, the
                # draft worker taking it on in that round's call (not in the background,
                # where a burst of short requests could end before it has them).
                reproducible_seeds=True,
            )
            if device != "auto":  # the workers' device: with the GPUs the placement reserves
                try:
                    placement = replace(placement or PlacementConfig(), device=device)
                except ValueError as error:
                    raise EngineInputError(str(error)) from None
            if batch_invariant:
                placement = replace(placement or PlacementConfig(), batch_invariant=True)
            self._init_distributed(
                target, draft, cluster, tp_size, draft_probs_encoding, placement,
                num_draft_workers, config, draft_placement,
            )  # fmt: skip
            return
        if tp_size != 1:
            raise EngineInputError(f"tp_size={tp_size} needs a cluster (cluster='auto')")
        try:
            where = resolve_device(device)
        except DeviceError as error:
            raise EngineInputError(str(error)) from None
        if isinstance(target, str):
            loaded = load_model(target, param="target", device=where, dtype=dtype)
        elif isinstance(target, torch.nn.Module):
            # An in-memory model runs where it is, unless a device was named: then it moves.
            moved = target if device == "auto" else target.to(where)
            loaded = LoadedModel(moved.eval(), tokenizer, path=None)
        else:
            raise EngineInputError(f"target must be a string or a model, got {target!r}")
        self.tokenizer = loaded.tokenizer
        self.target = ModelRunner(loaded.model, batch_invariant=batch_invariant)
        self.vocab_size = self.target.vocab_size
        self.max_positions = getattr(loaded.model.config, "max_position_embeddings", None)
        self.eos_token_ids = eos_token_ids(loaded.model, self.tokenizer)
        # structured outputs: the grammar compiler over the tokenizer (None without one)
        self.grammars = lazy_grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        if isinstance(draft, torch.nn.Module):
            from specray.drafters import FeatureDrafter, ModelDrafter, check_same_vocabulary

            runner = ModelRunner(draft)
            check_same_vocabulary(None, None, self.vocab_size, runner.vocab_size)
            reads_features = hasattr(draft, "embed_with_features")
            self.drafter = (FeatureDrafter if reads_features else ModelDrafter)(runner, encoding)
        elif draft is None or isinstance(draft, str):
            self.drafter = make_drafter(draft, loaded, self.vocab_size, encoding)
        else:
            self.drafter = draft
        # A feature-conditioned drafter reads the target's hidden states: the core keeps them.
        keep_features = bool(getattr(self.drafter, "needs_target_features", False))
        self.core = TargetCore(self.target, keep_features=keep_features)
        self.num_speculative_tokens = num_speculative_tokens if self.drafter else 0

    def _init_distributed(
        self,
        target,
        draft,
        cluster,
        tp_size,
        encoding,
        placement,
        num_draft_workers,
        config,
        draft_placement,
    ) -> None:
        if not isinstance(target, str):
            raise EngineInputError("a distributed engine needs target as a path or 'default'")
        if draft is not None and not isinstance(draft, str):
            raise EngineInputError("a distributed engine needs draft as a string or None")
        if not isinstance(cluster, str) or not cluster:
            raise EngineInputError(f"cluster must be 'auto' or a Ray address, got {cluster!r}")
        info = load_model_info(target, param="target")
        self.tokenizer = info.tokenizer
        self.vocab_size = info.vocab_size
        self.max_positions = info.max_positions
        self.eos_token_ids = info.eos_token_ids
        self.drafter = None
        self.num_speculative_tokens = config.num_speculative_tokens if draft is not None else 0
        placement = placement or PlacementConfig()
        connect(cluster, placement)
        backend = DistributedBackend(
            target,
            draft,
            tp_size=tp_size,
            num_draft_workers=num_draft_workers,
            draft_probs_encoding=encoding,
            placement=placement,
            draft_placement=draft_placement,
        )
        self.backend = backend
        address = backend.start_engine(config, max_positions=info.max_positions)
        self.runner = EngineCoreClient(address, tokenizer=info.tokenizer)

    def engine_stats(self) -> dict:
        """The distributed engine core's totals (``stats``), per-round message counters
        (``pool``: draft workers, ``sessions``: front-end batches) and Prometheus ``metrics``."""
        if self.backend is None:
            raise EngineInputError("engine_stats needs a distributed engine (cluster=...)")
        return self.backend.engine_stats()

    def shutdown(self) -> None:
        """Stop the distributed workers (no-op in process)."""
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        if self.backend is not None:
            self.backend.shutdown()
            self.backend = None

    # ---- inputs ------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int], *, use_chat_template: bool = True):
        """Text (chat template applied when the tokenizer has one) or token ids -> token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise EngineInputError("prompt text needs a tokenizer; pass token ids instead")
            return prompt_token_ids(self.tokenizer, prompt, use_chat_template=use_chat_template)
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
        token_ids = self._encode_checked(index, prompt, params, use_chat_template)
        seed = params.seed if params.seed is not None else random_seed()
        return RequestState.create(
            f"req-{next(self._ids)}",
            token_ids,
            params,
            seed,
            self.vocab_size,
            self.eos_token_ids,
            self.grammars,
        )

    def _encode_checked(self, index: int, prompt, params, use_chat_template: bool) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise EngineInputError(f"params must be SamplingParams, got {params!r}")
        token_ids = self.encode_prompt(prompt, use_chat_template=use_chat_template)
        if not token_ids:
            raise EngineInputError(f"prompts[{index}] is empty")
        if params.structured_outputs is not None and self.runner is None:  # (else: admission)
            try:
                check_structured_outputs(params, self.grammars is not None)
            except InvalidRequestError as error:
                raise SamplingParamsError("structured_outputs", str(error)) from None
        if self.max_positions and len(token_ids) + params.max_tokens > self.max_positions:
            raise EngineInputError(
                f"max_tokens={params.max_tokens} plus the {len(token_ids)}-token prompt exceeds "
                f"the model's {self.max_positions} positions"
            )
        return token_ids

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
        if self.runner is not None:
            ids = [
                self._encode_checked(index, prompt, request_params, use_chat_template)
                for index, (prompt, request_params) in enumerate(zip(prompts, params, strict=True))
            ]
            return self.runner.generate(ids, params)
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
        for index, request in enumerate(requests):
            if request.error is not None:  # its grammar wanted a token the vocabulary lacks
                raise EngineInputError(f"prompt {index}: {request.error}")
        return [request.to_output(self.tokenizer) for request in requests]

    def _release(self, request_ids: list[Hashable]) -> None:
        self.core.release(request_ids)
        if self.drafter is not None:
            self.drafter.release(request_ids)

    def _prefill(self, requests: list[RequestState]) -> None:
        started = time.perf_counter()
        self.core.prefill(requests)
        if getattr(self.drafter, "shares_target_architecture", False):
            self.drafter.import_prefill(self.target, [self._draft_request(r, 0) for r in requests])
        self.timing.prefill_s += time.perf_counter() - started

    def _round(self, requests: list[RequestState]) -> None:
        started = time.perf_counter()
        blocks = self._draft(requests)
        drafted = time.perf_counter()
        self.core.verify_round(requests, blocks)
        self.timing.draft_s += drafted - started
        self.timing.target_s += time.perf_counter() - drafted
        self.timing.rounds += 1

    def _draft(self, requests: list[RequestState]) -> dict[Hashable, Block]:
        blocks: dict[Hashable, Block] = {}
        asks = []
        for request in requests:
            k = min(self.num_speculative_tokens, request.remaining - 1)
            if k > 0:
                asks.append(self._draft_request(request, k))
        if asks:
            for ask, block in zip(asks, self.drafter.propose(asks), strict=True):
                if len(block.token_ids) > ask.num_tokens:
                    raise RuntimeError(
                        f"drafter proposed {len(block.token_ids)} tokens, asked {ask.num_tokens}"
                    )
                blocks[ask.request_id] = (block.token_ids, block.draft_probs)
        return blocks

    def _draft_request(self, request: RequestState, k: int) -> DraftRequest:
        features = None
        if self.core.keep_features:
            features = self.core.target_features(request.request_id)  # [T - 1, hidden]
        return DraftRequest(
            request.request_id,
            request.prompt_token_ids,
            request.output_token_ids,
            request.pipeline,
            request.random,
            k,
            target_features=features,
        )
