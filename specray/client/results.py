"""What the client returns: plain frozen dataclasses built from the response messages."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from specray.v1 import generation_pb2 as pb


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities (natural log): the token there and the most likely."""

    token_id: int
    logprob: float  # -inf where the processed distribution excludes it
    rank: int  # 1 + the tokens strictly more likely
    top_token_ids: tuple[int, ...]  # the most likely first, as many as asked
    top_logprobs: tuple[float, ...]

    @staticmethod
    def from_proto(message: pb.TokenLogprob) -> TokenLogprob:
        return TokenLogprob(
            token_id=message.token_id,
            logprob=message.logprob,
            rank=message.rank,
            top_token_ids=tuple(message.top_token_ids),
            top_logprobs=tuple(message.top_logprobs),
        )


def _logprobs(messages) -> tuple[TokenLogprob, ...] | None:
    """None when the request did not ask (the message holds none)."""
    return tuple(map(TokenLogprob.from_proto, messages)) or None


def _prompt_logprobs(messages) -> tuple[TokenLogprob | None, ...] | None:
    """vLLM's shape: None for the first prompt token (the message starts at the second)."""
    entries = _logprobs(messages)
    return None if entries is None else (None, *entries)


@dataclass(frozen=True)
class Completion:
    """A finished generation: the whole output, its usage and its speculative metrics."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    seed: int  # the seed it ran with: send it back to reproduce a sampled output
    speculative_decoding: Mapping[str, float | int | tuple[int, ...]] = field(
        default_factory=lambda: MappingProxyType({})
    )  # num_drafts, num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos, ...
    time_to_first_token_s: float | None = None
    latency_s: float | None = None  # arrival to the last token, on the server
    # With ``logprobs``: one per token of token_ids. With ``prompt_logprobs``: one per prompt
    # token, None for the first (nothing precedes it), as vLLM's. None when not asked (and
    # for the prompt's when it has a single token: the message carries no position then).
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    @property
    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    @staticmethod
    def from_proto(final: pb.Final) -> Completion:
        spec = final.speculative_decoding
        return Completion(
            request_id=final.request_id,
            text=final.text,
            token_ids=tuple(final.token_ids),
            finish_reason=final.finish_reason,
            prompt_tokens=final.prompt_tokens,
            completion_tokens=final.completion_tokens,
            seed=final.seed,
            speculative_decoding=MappingProxyType(
                {
                    "num_drafts": spec.num_drafts,
                    "num_draft_tokens": spec.num_draft_tokens,
                    "num_accepted_tokens": spec.num_accepted_tokens,
                    "num_accepted_tokens_per_pos": tuple(spec.num_accepted_tokens_per_pos),
                    "acceptance_rate": spec.acceptance_rate,
                    "mean_acceptance_length": spec.mean_acceptance_length,
                }
            ),
            time_to_first_token_s=final.time_to_first_token_s
            if final.HasField("time_to_first_token_s")
            else None,
            latency_s=final.latency_s if final.HasField("latency_s") else None,
            logprobs=_logprobs(final.logprobs),
            prompt_logprobs=_prompt_logprobs(final.prompt_logprobs),
        )


@dataclass(frozen=True)
class Chunk:
    """One streamed piece: newly committed tokens and their text. The last chunk of a stream
    has no new tokens and carries the :class:`Completion`."""

    text: str
    token_ids: tuple[int, ...]
    completion: Completion | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token (when asked)

    @staticmethod
    def from_proto(response: pb.GenerateResponse) -> Chunk:
        if response.WhichOneof("event") == "final":
            return Chunk("", (), Completion.from_proto(response.final))
        delta = response.delta
        return Chunk(delta.text, tuple(delta.token_ids), logprobs=_logprobs(delta.logprobs))


@dataclass(frozen=True)
class ModelInfo:
    model: str  # the served name
    max_model_len: int | None  # prompt + output tokens at most; None: not known
    vocab_size: int
    draft: str | None  # None: no draft model
    num_speculative_tokens: int  # the largest k
    eos_token_ids: tuple[int, ...]

    @staticmethod
    def from_proto(info: pb.ModelInfo) -> ModelInfo:
        return ModelInfo(
            model=info.model,
            max_model_len=info.max_model_len or None,
            vocab_size=info.vocab_size,
            draft=info.draft or None,
            num_speculative_tokens=info.num_speculative_tokens,
            eos_token_ids=tuple(info.eos_token_ids),
        )
