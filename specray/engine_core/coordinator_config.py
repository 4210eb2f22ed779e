"""The coordinator's settings: one frozen, validated config per target group, and the cost
priors it starts from before measurements arrive."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from specray.engine_core.policy import DraftCost, PolicyConfig, VerifyCost
from specray.sampling.limits import MAX_SPEC_LEN

# Cost priors until measurements arrive (seconds): verification barely growing with tokens and
# a cheap draft, so speculation starts on and the fits take over within a few rounds.
DEFAULT_VERIFY_PRIOR = VerifyCost(fixed_s=0.05, per_request_s=0.01, per_token_s=0.003)
DEFAULT_DRAFT_PRIOR = DraftCost(fixed_s=0.02, per_request_s=0.005)


# The one default of each setting shared by the engine, the served application (AppArgs) and
# the coordinator.
DEFAULT_NUM_SPECULATIVE_TOKENS = 4  # the largest k
DEFAULT_DRAFT_DEADLINE_S = 5.0  # how long the target waits for a block before going alone


@dataclass(frozen=True)
class CoordinatorConfig:
    """How one coordinator batches, pipelines and speculates over its target group (each field
    explained where it is declared); validated on construction, so a bad value fails where it
    is set, naming the field."""

    max_running: int = 64  # requests decoded at once (continuous batching)
    max_queue: int = 256  # admitted requests waiting for a slot; beyond: OverloadedError
    num_micro_batches: int = 2  # 1 = unpipelined rounds; 2+ = draft one while verifying another
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS  # the largest k
    adaptive_k: bool = True  # choose k per request and round from measurements
    draft_ahead: bool = True  # the draft keeps drafting while its block is verified
    # ... before the verdict only for a block kept whole with at least this probability (after
    # it, from the committed tokens, always); 0: always
    draft_ahead_min_hit: float = 0.5
    draft_deadline_s: float = DEFAULT_DRAFT_DEADLINE_S  # the target waits this long for a block
    # Async scheduling, in a group without draft workers: while the target runs a round, the
    # micro-batch's next round is already queued behind it, so the target never waits for the
    # coordinator's turn between two forwards (commits, stream deltas, the next round's
    # items). A request the running round ends costs nothing in the queued one (the target
    # skips it); one submitted meanwhile joins the queued round until the target starts it.
    # Off by default: the turn and the forward share one process's GIL, which can cost more
    # than the overlap gains (measured: docs/bench/history.md, "Async scheduling").
    async_scheduling: bool = False
    # Chunked prefill: per micro-batch round, the target prefills at most this many prompt
    # tokens of requests new to it, first come first served, beside the others' decoding, so a
    # long prompt stalls the running requests for one chunk a round instead of its whole
    # prefill. 0 (default): every prompt whole in its first round. A budget delays new
    # requests (time to first token) and, when many prompts arrive at once, throughput: set
    # it when prompts are long next to what a round decodes.
    max_prefill_tokens_per_round: int = 0
    # An idle micro-batch whose last round ended several requests waits up to this long (and
    # at most that round's time) for as many submissions before its next round:
    # clients in a closed loop send their next requests within a front end's turnaround of
    # each other, and a round started on the first of them would prefill the others one or
    # two rounds later, out of step for the rest of their lives. 0: start at once.
    arrival_hold_s: float = 0.005
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
        for name in ("adaptive_k", "draft_ahead", "reproducible_seeds", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not self.draft_deadline_s > 0:
            raise ValueError(f"draft_deadline_s must be > 0, got {self.draft_deadline_s!r}")
        if not 0 <= self.draft_ahead_min_hit <= 1:
            raise ValueError(
                f"draft_ahead_min_hit must be in [0, 1], got {self.draft_ahead_min_hit!r}"
            )
        if not 0 <= self.arrival_hold_s <= 1:
            raise ValueError(f"arrival_hold_s must be in [0, 1], got {self.arrival_hold_s!r}")
        if not self.rtt_prior_s >= 0:
            raise ValueError(f"rtt_prior_s must be >= 0, got {self.rtt_prior_s!r}")
        if self.policy.max_k != self.num_speculative_tokens:
            # One source of truth for the largest k.
            object.__setattr__(
                self, "policy", replace(self.policy, max_k=self.num_speculative_tokens)
            )
