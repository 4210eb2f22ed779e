"""Keyword arguments -> ``GenerateRequest`` message. Only the shape is checked here (one prompt,
known names, types the wire can carry); values are validated once, by the server, whose
INVALID_ARGUMENT message names the parameter and the value."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from specray.client.errors import invalid_argument
from specray.v1 import generation_pb2 as pb

SAMPLING_PARAMS = (  # as specray.sampling.SamplingParams
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "allowed_token_ids",
    "banned_token_ids",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "seed",
    "logprobs",  # 0..20: each output token's log-probability and that many most likely
    "prompt_logprobs",  # the same for the prompt's tokens
    "logprobs_mode",  # "raw" (the model's, the default) or "processed" (what was drawn from)
    "structured_outputs",  # (kind, spec): the output follows a grammar (StructuredOutputs)
)
REQUEST_OPTIONS = ("stop", "num_speculative_tokens", "speculation", "request_id")


class StructuredOutputs(NamedTuple):
    """The ``structured_outputs`` option: the output follows a grammar. A plain ``(kind, spec)``
    tuple works as well; the constructors spell the kinds::

        client.generate("A colour as JSON:", structured_outputs=StructuredOutputs.json(schema))
    """

    kind: str  # "json", "json_object", "regex", "choice" or "grammar"
    spec: str  # the schema's JSON text, "", the regex, the choices' JSON text, the EBNF

    @classmethod
    def json(cls, schema: Mapping[str, Any] | str) -> StructuredOutputs:
        """A JSON schema, as a mapping or its JSON text."""
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> StructuredOutputs:
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutputs:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredOutputs:
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredOutputs:
        """EBNF in xgrammar's dialect (``root ::= ...``)."""
        return cls("grammar", ebnf)


def build_request(
    prompt: str | None,
    messages: Sequence[Mapping[str, str]] | None,
    prompt_token_ids: Sequence[int] | None,
    options: Mapping[str, Any],
) -> pb.GenerateRequest:
    """The request for one prompt form and ``options`` (sampling parameters, ``stop``,
    ``num_speculative_tokens``, ``speculation``: "auto", "on" or "off", ``request_id``);
    options set to None are left unset."""
    given = [
        name
        for name, value in (
            ("prompt", prompt),
            ("messages", messages),
            ("prompt_token_ids", prompt_token_ids),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise invalid_argument(
            f"exactly one of prompt, messages or prompt_token_ids must be given, got {given}"
        )
    unknown = sorted(set(options) - set(SAMPLING_PARAMS) - set(REQUEST_OPTIONS))
    if unknown:
        raise invalid_argument(f"unknown sampling parameter {unknown[0]!r}")
    request = pb.GenerateRequest()
    _set_prompt(request, prompt, messages, prompt_token_ids)
    for name, value in options.items():
        if value is None:
            continue
        try:
            _set_option(request, name, value)
        except (TypeError, ValueError) as error:  # protobuf's own type and range checks
            raise invalid_argument(f"{name}={value!r} cannot be sent: {error}") from error
    return request


def _set_prompt(request: pb.GenerateRequest, prompt, messages, prompt_token_ids) -> None:
    if prompt is not None:
        if not isinstance(prompt, str):
            raise invalid_argument(f"prompt must be a string, got {prompt!r}")
        request.text = prompt
    elif prompt_token_ids is not None:
        if isinstance(prompt_token_ids, (str, bytes)):
            raise invalid_argument(f"prompt_token_ids must be integers, got {prompt_token_ids!r}")
        try:
            request.token_ids.SetInParent()  # an empty list is still a prompt (and rejected)
            request.token_ids.ids.extend(prompt_token_ids)
        except (TypeError, ValueError) as error:
            raise invalid_argument(
                f"prompt_token_ids must be integers, got {prompt_token_ids!r}"
            ) from error
    else:
        if isinstance(messages, (str, bytes, Mapping)):
            raise invalid_argument(
                f"messages must be a list of {{role, content}}, got {messages!r}"
            )
        request.messages.SetInParent()
        for index, message in enumerate(messages):
            if not (
                isinstance(message, Mapping)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise invalid_argument(
                    f"messages[{index}] must be {{role: str, content: str}}, got {message!r}"
                )
            request.messages.messages.add(role=message["role"], content=message["content"])


def _set_option(request: pb.GenerateRequest, name: str, value: Any) -> None:
    if name == "logit_bias":
        if not isinstance(value, Mapping):
            raise TypeError("logit_bias must be a mapping of token id to bias")
        for token_id, bias in value.items():
            request.logit_bias[int(token_id) if isinstance(token_id, str) else token_id] = bias
    elif name == "allowed_token_ids":
        request.allowed_token_ids.SetInParent()  # set, even when empty (the server rejects [])
        request.allowed_token_ids.ids.extend(value)
    elif name in ("banned_token_ids", "stop_token_ids"):
        getattr(request, name).extend(value)
    elif name == "stop":
        request.stop.extend([value] if isinstance(value, str) else value)
    elif name == "structured_outputs":
        if (
            isinstance(value, (str, bytes))
            or not isinstance(value, Sequence)
            or len(value) != 2
            or not all(isinstance(part, str) for part in value)
        ):
            raise TypeError("structured_outputs must be (kind, spec), two strings")
        request.structured_outputs.kind, request.structured_outputs.spec = value
    else:
        setattr(request, name, value)
