"""Validated, frozen sampling parameters (vLLM-shaped).

Every field is checked in ``__post_init__``; errors name the parameter and the value.
Token ids are checked against the vocabulary by :meth:`SamplingParams.check_vocab`, which the
engine calls when a request is admitted (the vocabulary is not known at construction).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

MAX_SEED = 2**63 - 1  # seeds are non-negative 63-bit integers (fit int64 on every wire)
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on |logit_bias|
GREEDY_TEMPERATURE = 1e-5  # temperatures below this mean greedy (as in vLLM)
MAX_PENALTY = 2.0  # presence / frequency penalties live in [-2, 2], as in OpenAI and vLLM
# Beyond these, float32 logits overflow or lose every difference (logit / temperature,
# logit * or / repetition_penalty) and the distribution becomes NaN.
MAX_TEMPERATURE = 1e4
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-4, 1e4
MAX_BIAS_KEY_DIGITS = 20  # token ids are far shorter; int() refuses > 4300 digits anyway
MAX_LOGPROBS = 20  # most likely tokens reported per position at most (OpenAI's top_logprobs)
LOGPROBS_MODES = ("raw", "processed")
LOGPROBS_MODE_ALIASES = {"raw_logprobs": "raw", "processed_logprobs": "processed"}  # vLLM's


class SamplingParamsError(ValueError):
    """A sampling parameter is invalid; the message names the parameter and the value."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _fail(param: str, message: str) -> None:
    raise SamplingParamsError(param, message)


def _check_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(name, f"{name} must be a number, got {_short(value)}")
    try:
        number = float(value)  # an int past float's range overflows here, not in the pipeline
    except OverflowError:
        _fail(name, f"{name} must be a finite number, got {_short(value)}")
    if not math.isfinite(number):
        _fail(name, f"{name} must be finite, got {_short(value)}")
    return number


def _short(value: Any) -> str:
    """repr, cut short: a 400-digit int must not flood the error (nor hit int's str limit)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**20:
        return f"an integer of about {value.bit_length() * 0.30103:.0f} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, f"{name} must be an integer, got {value!r}")
    return value


def _token_tuple(name: str, value: Iterable[int] | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        _fail(name, f"{name} must be a list of token ids, got {value!r}")
    ids = tuple(value)
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            _fail(name, f"{name} must hold non-negative integer token ids, got {token_id!r}")
    return tuple(sorted(set(ids)))


NUMBER_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
TOKEN_TUPLE_FIELDS = ("allowed_token_ids", "banned_token_ids", "stop_token_ids")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token. Defaults follow vLLM (temperature 1, no filters, 16 tokens)."""

    temperature: float = 1.0  # < 1e-5 = greedy (argmax after bias, masks and penalties)
    top_k: int = 0  # keep the k most likely tokens (ties at the k-th value kept); 0 = off
    top_p: float = 1.0  # keep the smallest set with cumulative probability >= top_p
    min_p: float = 0.0  # drop tokens below min_p * max probability; 0 = off
    repetition_penalty: float = 1.0  # > 1 discourages tokens of prompt and output (CTRL rule)
    presence_penalty: float = 0.0  # subtracted once from tokens present in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> added logit
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled; None = all
    banned_token_ids: tuple[int, ...] | None = None  # never sampled
    stop_token_ids: tuple[int, ...] | None = None  # finish after emitting one of these
    ignore_eos: bool = False  # do not stop at the model's end-of-sequence token
    max_tokens: int = 16  # generated tokens at most
    # before this many output tokens, the stop ids (EOS unless ignore_eos, and stop_token_ids)
    # cannot be drawn: vLLM's min_tokens, a position-dependent mask of the pipeline
    min_tokens: int = 0
    seed: int | None = None  # None: the engine picks one and reports it in the output
    # Log-probabilities (specray.sampling.logprobs): None = off; n = each output token's own
    # and the n most likely (0..20); prompt_logprobs the same for the prompt (raw always).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str = "raw"  # "raw" (the model's) or "processed" (what it was drawn from)
    # (kind, spec): the output follows a grammar (specray.sampling.grammar: json, json_object,
    # regex, choice, grammar); its mask is a logits option like any other
    structured_outputs: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        # Numbers are stored back as floats, so the pipeline never sees a huge int.
        for name in NUMBER_FIELDS:
            object.__setattr__(self, name, _check_number(name, getattr(self, name)))
        temperature = self.temperature
        if not 0 <= temperature <= MAX_TEMPERATURE:
            _fail(
                "temperature",
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature!r}",
            )
        top_k = _check_int("top_k", self.top_k)
        if top_k < 0:
            _fail("top_k", f"top_k must be >= 0 (0 disables it), got {top_k!r}")
        top_p = self.top_p
        if not 0 < top_p <= 1:
            _fail("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        min_p = self.min_p
        if not 0 <= min_p <= 1:
            _fail("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        repetition = self.repetition_penalty
        if not MIN_REPETITION_PENALTY <= repetition <= MAX_REPETITION_PENALTY:
            _fail(
                "repetition_penalty",
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                _fail(name, f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not isinstance(self.logit_bias, Mapping):
            _fail("logit_bias", f"logit_bias must be a mapping, got {self.logit_bias!r}")
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            # isdigit() accepts "²" and int() refuses > 4300 digits: ASCII decimals, capped.
            if (
                isinstance(key, str)
                and key.isascii()
                and key.isdecimal()
                and len(key) <= MAX_BIAS_KEY_DIGITS
            ):
                token_id = int(key)
            else:
                token_id = key
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                _fail("logit_bias", f"logit_bias keys must be token ids, got {_short(key)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                _fail("logit_bias", f"logit_bias[{token_id}] must be a number, got {value!r}")
            try:
                number = _check_number("logit_bias", value)
            except SamplingParamsError:
                _fail("logit_bias", f"logit_bias[{token_id}] must be finite, got {_short(value)}")
            if abs(number) > MAX_LOGIT_BIAS:
                _fail(
                    "logit_bias",
                    f"logit_bias[{token_id}] must be in [-100, 100], got {value!r}",
                )
            bias[token_id] = number
        object.__setattr__(self, "logit_bias", MappingProxyType(bias))
        for name in TOKEN_TUPLE_FIELDS:
            object.__setattr__(self, name, _token_tuple(name, getattr(self, name)))
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                _fail("allowed_token_ids", "allowed_token_ids must not be empty, got []")
            if set(self.allowed_token_ids) <= set(self.banned_token_ids or ()):
                _fail(
                    "banned_token_ids",
                    f"banned_token_ids {list(self.banned_token_ids or ())} ban every "
                    f"allowed token {list(self.allowed_token_ids)}",
                )
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        max_tokens = _check_int("max_tokens", self.max_tokens)
        if max_tokens < 1:
            _fail("max_tokens", f"max_tokens must be >= 1, got {max_tokens!r}")
        min_tokens = _check_int("min_tokens", self.min_tokens)
        if not 0 <= min_tokens <= max_tokens:
            _fail(
                "min_tokens",
                f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens!r}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= _check_int(name, value) <= MAX_LOGPROBS:
                _fail(name, f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        mode = LOGPROBS_MODE_ALIASES.get(self.logprobs_mode, self.logprobs_mode)
        if mode not in LOGPROBS_MODES:
            _fail(
                "logprobs_mode",
                f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {self.logprobs_mode!r}",
            )
        object.__setattr__(self, "logprobs_mode", mode)
        if self.structured_outputs is not None:
            self._check_structured_outputs()
        if self.seed is not None:
            seed = _check_int("seed", self.seed)
            if not 0 <= seed <= MAX_SEED:
                _fail("seed", f"seed must be in [0, 2**63 - 1], got {seed!r}")

    def _check_structured_outputs(self) -> None:
        from specray.sampling.grammar_spec import GrammarError, check_spec

        value = self.structured_outputs
        if isinstance(value, str | bytes) or not isinstance(value, tuple | list) or len(value) != 2:
            _fail(
                "structured_outputs",
                f"structured_outputs must be (kind, spec), got {_short(value)}",
            )
        try:
            check_spec(*value)
        except GrammarError as error:
            _fail("structured_outputs", str(error))
        object.__setattr__(self, "structured_outputs", tuple(value))
        if self.min_tokens:  # a complete grammar allows only the stop tokens min_tokens masks
            _fail(
                "min_tokens",
                f"min_tokens={self.min_tokens} cannot be combined with structured_outputs",
            )
        for name in ("allowed_token_ids", "banned_token_ids"):  # may take every allowed token
            if getattr(self, name):
                _fail(name, f"{name} cannot be combined with structured_outputs")

    @property
    def greedy(self) -> bool:
        # Below GREEDY_TEMPERATURE, logits / temperature overflows float32: the limit is argmax.
        return self.temperature < GREEDY_TEMPERATURE

    def __hash__(self) -> int:
        values = [getattr(self, f.name) for f in fields(self)]
        values[[f.name for f in fields(self)].index("logit_bias")] = tuple(self.logit_bias.items())
        return hash(tuple(values))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SamplingParams:
        """Build from a plain mapping (JSON, CLI); unknown keys are errors."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            _fail(unknown[0], f"unknown sampling parameter {unknown[0]!r}")
        return cls(**values)

    @classmethod
    def trusted(cls, values: Mapping[str, Any]) -> SamplingParams:
        """Rebuild parameters that were validated at the public edge and crossed an internal
        wire (:mod:`specray.protocol`): no second validation, only the field types restored."""
        params = object.__new__(cls)
        for name in _FIELD_NAMES:
            value = values[name]
            if name == "logit_bias":
                value = MappingProxyType({int(key): float(bias) for key, bias in value.items()})
            elif (name in TOKEN_TUPLE_FIELDS or name == "structured_outputs") and value is not None:
                value = tuple(value)
            object.__setattr__(params, name, value)
        return params

    def check_vocab(self, vocab_size: int, eos_token_ids: frozenset[int] = frozenset()) -> None:
        """Raise SamplingParamsError if any token id is outside ``[0, vocab_size)``, or if no
        token is left to draw before ``min_tokens`` (the stop ids, ``eos_token_ids`` unless
        ignore_eos, masked there besides the banned ones)."""
        groups = {
            "logit_bias": tuple(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids or (),
            "banned_token_ids": self.banned_token_ids or (),
            "stop_token_ids": self.stop_token_ids or (),
        }
        for name, ids in groups.items():
            for token_id in ids:
                if token_id >= vocab_size:
                    _fail(
                        name,
                        f"{name} holds token id {token_id}, outside the vocabulary "
                        f"[0, {vocab_size})",
                    )
        # Sorted, unique and in range: banning vocab_size ids bans every token (a NaN row).
        if len(self.banned_token_ids or ()) >= vocab_size:
            _fail("banned_token_ids", f"banned_token_ids ban every token of the {vocab_size}")
        if self.min_tokens:
            stops = set(self.stop_token_ids or ()) | (set() if self.ignore_eos else eos_token_ids)
            masked = stops | set(self.banned_token_ids or ())
            if self.allowed_token_ids is None:
                nothing_left = len(masked) >= vocab_size  # ids checked in range above (eos: ours)
            else:
                nothing_left = set(self.allowed_token_ids) <= masked
            if nothing_left:
                _fail(
                    "min_tokens",
                    f"min_tokens={self.min_tokens} masks the stop ids {sorted(stops)}, which "
                    f"leaves no token to draw before it",
                )

    def with_seed(self, seed: int) -> SamplingParams:
        from dataclasses import replace

        return replace(self, seed=seed, logit_bias=dict(self.logit_bias))


_FIELD_NAMES = tuple(f.name for f in fields(SamplingParams))
