"""The application's arguments: one typed, validated model for ``serve run``, a
``serve_config.yaml`` and ``specray serve`` alike. Unknown keys are errors."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specray.cluster.placement import PlacementConfig, resolve_draft_placement
from specray.engine_core.coordinator_config import (
    DEFAULT_DRAFT_DEADLINE_S,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    CoordinatorConfig,
)

DEFAULT_GRPC_PORT = 50051
REPLICA_CPUS_DEFAULT = 0.05  # Serve replica processes mostly wait on their actors
REPLICA_SLIVER = 0.001  # the share of a node resource a replica asks to be placed by it (app.py)
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the bundled default target


class AppArgs(BaseModel):
    """Arguments of :func:`specray.serve.build_app` (``serve run specray.serve:build_app
    target=default draft=self:bf16 grpc_port=50051``: values given as text are converted)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = "default"  # "default" (bundled), a model directory or a .gguf file
    draft: str | None = "default"  # "none" = target-only; "ngram", "self:bf16", a directory
    model_name: str | None = None  # the name clients use; default: the target's
    tp_size: int = Field(1, ge=1)  # TP ranks per target group (one placement group each)
    num_target_groups: int = Field(1, ge=1)  # TargetWorker replicas = Coordinator replicas
    num_draft_workers: int = Field(1, ge=1)  # per target group: the pool, or its floor
    max_draft_workers: int | None = Field(None, ge=1)  # per group: autoscaling ceiling (or fixed)
    draft_probs_encoding: str = "fp32"
    # Where the draft runs: "workers", a DraftWorker pool on draft nodes (streams over gRPC);
    # "colocated", one draft worker inside each target group's rank 0, beside the engine core
    # (no hop per round; the draft shares the target's device and threads); "auto", colocated
    # for a draft small beside its target unless the pool is sized (resolve_draft_placement).
    draft_placement: Literal["auto", "workers", "colocated"] = "auto"
    num_speculative_tokens: int = Field(DEFAULT_NUM_SPECULATIVE_TOKENS, ge=0, le=32)
    max_running: int = Field(64, ge=1)
    max_queue: int = Field(256, ge=0)
    num_micro_batches: int = Field(2, ge=1, le=16)
    draft_deadline_s: float = Field(DEFAULT_DRAFT_DEADLINE_S, gt=0)
    adaptive_k: bool = True  # choose k per request and round from measurements (else always k)
    # Time the target's forwards when a group starts (seconds on a CPU): the policy starts
    # from this group's own verify costs rather than generic priors (with adaptive_k and a
    # draft only; the draft's cost is fitted from its first rounds)
    calibrate: bool = True
    # Seeded requests draft a fixed block, so their tokens depend on the seed alone (see
    # CoordinatorConfig.reproducible_seeds)
    reproducible_seeds: bool = False
    # Chunked prefill: prompt tokens the target prefills per round beside decoding (0: whole
    # prompts; see CoordinatorConfig.max_prefill_tokens_per_round)
    max_prefill_tokens_per_round: int = Field(0, ge=0)
    # A target-only group queues its next round before the verdict of the running one (see
    # CoordinatorConfig.async_scheduling)
    async_scheduling: bool = False
    # An idle group waits up to this long for a closed loop's next requests before its next
    # round (see CoordinatorConfig.arrival_hold_s; 0: never)
    arrival_hold_s: float = Field(0.005, ge=0, le=1)
    # Placement by node type (Ray custom resources) and CPU shares.
    draft_resource: str = "draft"
    target_resource: str = "target"
    draft_num_cpus: float = Field(0.5, gt=0)
    target_num_cpus: float = Field(0.5, gt=0)
    draft_num_gpus: float = Field(0.0, ge=0)  # per draft worker (a fraction shares a GPU)
    target_num_gpus: float = Field(0.0, ge=0)  # per TP rank: 1 on GPU target nodes
    num_threads: int = Field(1, ge=1)
    # Where workers run their models: auto | cpu | cuda | cuda:N (specray/models/device.py);
    # "auto" takes the GPUs the *_num_gpus above reserve, and the CPU without them.
    device: str = "auto"
    # Targets compute a token's logits bitwise the same in any batch, with and without
    # speculation (identical logprobs; slower: specray/models/batch_invariant.py).
    batch_invariant: bool = False
    # Front ends.
    grpc_port: int | None = Field(DEFAULT_GRPC_PORT, ge=0, le=65535)  # None: no gRPC API
    auth_token: str | None = None  # bearer token both APIs require (health checks excepted)
    # Or the name of an environment variable that holds it, read where the Ingress runs: the
    # token then stays out of the Serve config (and a RayService spec, and the dashboard).
    auth_token_env: str | None = None
    tls_cert: str | None = None  # PEM files: server certificate and key (TLS on both APIs)
    tls_key: str | None = None
    tls_client_ca: str | None = None  # gRPC: require client certificates signed by it (mTLS)
    num_ingress_replicas: int = Field(1, ge=1)
    # Pin the Ingress (and so the gRPC API) to the head node, next to Serve's HTTP proxy
    # (proxy_location HeadOnly): on a cluster both APIs are then at the head's address.
    ingress_on_head: bool = False
    # How the draft pool scales between num_ and max_draft_workers (specray.cluster.autoscaling):
    # "application": the app-level policy (needs a deploy config: `specray serve`, serve deploy);
    # "deployment": the draft pool's own policy (serve run); "plain": Serve's request-based rule.
    autoscaling: Literal["application", "deployment", "plain"] = "deployment"
    startup_timeout_s: float = Field(600.0, gt=0)  # a coordinator waits this long for targets

    @field_validator("draft", mode="before")
    @classmethod
    def _none_draft(cls, value):
        return None if isinstance(value, str) and value.lower() in ("none", "") else value

    @field_validator("tls_cert", "tls_key", "tls_client_ca")
    @classmethod
    def _pem_exists(cls, value):
        if value is not None and not Path(value).is_file():
            raise ValueError(f"no such file: {value!r}")
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        if self.auth_token is not None and self.auth_token_env is not None:
            raise ValueError("give auth_token or auth_token_env, not both")
        if self.max_draft_workers is not None and self.max_draft_workers < self.num_draft_workers:
            raise ValueError(
                f"max_draft_workers ({self.max_draft_workers}) must be >= num_draft_workers "
                f"({self.num_draft_workers})"
            )
        if self.draft_placement == "colocated" and (
            self.num_draft_workers != 1 or self.max_draft_workers is not None
        ):
            raise ValueError(
                "draft_placement='colocated' runs one draft in each target group: "
                f"num_draft_workers={self.num_draft_workers} and max_draft_workers="
                f"{self.max_draft_workers} are for draft_placement='workers'"
            )
        self.coordinator_config()  # the coordinator's own checks
        self.placement()
        return self

    @property
    def served_name(self) -> str:
        if self.model_name:
            return self.model_name
        return DEFAULT_MODEL_NAME if self.target == "default" else Path(self.target).name

    def resolved_auth_token(self) -> str | None:
        """The bearer token: ``auth_token``, or the value of ``auth_token_env`` here."""
        if self.auth_token_env is None:
            return self.auth_token
        token = os.environ.get(self.auth_token_env)
        if not token:
            raise ValueError(
                f"auth_token_env={self.auth_token_env!r}: that environment variable is not set "
                "(or empty) where the Ingress runs"
            )
        return token

    @functools.cached_property
    def resolved_draft_placement(self) -> str:
        """``"workers"`` or ``"colocated"`` (``"auto"`` resolved: it reads the target's and
        the draft's files, so :func:`~specray.serve.build_app` resolves it once and hands
        every deployment the result)."""
        return resolve_draft_placement(
            self.draft_placement,
            self.draft,
            self.target,
            pool_sized=self.num_draft_workers != 1 or self.max_draft_workers is not None,
        )

    @property
    def draft_pool(self) -> bool:
        """A DraftWorker pool is deployed (a draft, not colocated)."""
        return self.draft is not None and self.resolved_draft_placement == "workers"

    @property
    def autoscaled(self) -> bool:
        return self.draft is not None and self.max_draft_workers is not None

    def autoscaling_settings(self):
        from specray.cluster.scaling_rules import AutoscalingSettings

        return AutoscalingSettings(
            min_drafts_per_group=self.num_draft_workers,
            max_drafts_per_group=self.max_draft_workers or self.num_draft_workers,
            scale_target_groups=False,  # a target group is a big model: sized by hand here
            min_target_groups=self.num_target_groups,
            max_target_groups=self.num_target_groups,
        )

    def coordinator_config(self) -> CoordinatorConfig:
        return CoordinatorConfig(
            max_running=self.max_running,
            max_queue=self.max_queue,
            num_micro_batches=self.num_micro_batches,
            num_speculative_tokens=self.num_speculative_tokens if self.draft else 0,
            draft_deadline_s=self.draft_deadline_s,
            adaptive_k=self.adaptive_k,
            reproducible_seeds=self.reproducible_seeds,
            max_prefill_tokens_per_round=self.max_prefill_tokens_per_round,
            async_scheduling=self.async_scheduling,
            arrival_hold_s=self.arrival_hold_s,
        )

    def placement(self) -> PlacementConfig:
        return PlacementConfig(
            draft_resource=self.draft_resource,
            target_resource=self.target_resource,
            draft_num_cpus=self.draft_num_cpus,
            target_num_cpus=self.target_num_cpus,
            draft_num_gpus=self.draft_num_gpus,
            target_num_gpus=self.target_num_gpus,
            num_threads=self.num_threads,
            device=self.device,
            batch_invariant=self.batch_invariant,
        )
