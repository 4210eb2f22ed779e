"""OpenAI request bodies in, :class:`GenerateRequest` per choice (responses out:
:mod:`specray.serve.openai_responses`). Plain dicts, no web framework and no torch.

Decisions a user of vLLM's OpenAI server would otherwise guess at:

- A field that is neither OpenAI's, vLLM's nor specray's is an error (400 naming it): a
  silently ignored typo (``max_token``) returns a plausible wrong answer. OpenAI fields that
  cannot change what is generated (``store``, ``metadata``, ``service_tier``, ...) are
  accepted and ignored, as vLLM does; a missing ``model`` means the served one.
- Every choice is its own backend request. Its request id is the response ``id`` when the call
  has one choice, else ``f"{id}-{index}"`` (abort by id either way). With an explicit ``seed``
  choice i of each prompt runs with ``seed + i``: n > 1 draws differ and replay exactly.
- A list of prompts runs concurrently; choice ``index = prompt_index * n + i`` (as vLLM).
- Speculative-decoding metrics (vLLM's names) sit on every choice (each choice is a request)
  and, merged over the choices, at the top level of the response, or of the usage chunk when
  streaming with ``stream_options.include_usage``.
- ``usage.prompt_tokens`` counts each prompt once however many choices it has (as OpenAI).
- Log-probabilities: completions' ``logprobs`` n and chat's ``logprobs`` / ``top_logprobs`` n
  (0..20, as vLLM; OpenAI caps completions at 5), ``echo`` on completions (with ``logprobs``
  the prompt's tokens are scored too), vLLM's ``prompt_logprobs`` on both (not with
  ``stream``, as vLLM), and ``logprobs_mode`` per request: "raw" (the model's distribution,
  the default) or "processed" (the one the token was drawn from); vLLM's names
  "raw_logprobs" / "processed_logprobs" are accepted.
- Structured outputs (``response_format``, vLLM's ``structured_outputs`` and ``guided_*``, on
  both endpoints) and chat's ``tools`` / ``tool_choice``: :mod:`specray.serve.openai_structured`
  (one constraint per call, compiled here; its errors name the user's field).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specray.errors import InvalidRequestError, SpecrayError
from specray.serve.openai_fields import (
    boolean,
    integer,
    invalid,
    is_int,
    logit_bias,
    number,
    show,
    string,
    token_ids,
    top_k,
)
from specray.serve.openai_structured import (
    STRUCTURED_FIELDS,
    Constraint,
    ToolCalling,
    output_constraint,
    tool_calling,
)
from specray.serve.protocol import (
    SPECULATION_MODES,
    GenerateRequest,
    check_grammar_params,
    check_messages,
)

MAX_CHOICES = 128  # prompts x n in one call (OpenAI caps n at 128)
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs at most (SamplingParams' MAX_LOGPROBS, OpenAI's)


class HttpError(SpecrayError):
    """An error only the HTTP layer raises (auth, media type, body size, routing, model
    name): its status, ``error.type`` and ``error.code`` are chosen where it is raised."""

    def __init__(
        self,
        http_status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message, param=param)
        self.http_status, self.error_type, self.code = http_status, error_type, code


# OpenAI / vLLM field -> its check; the checked value goes to SamplingParams under that name.
SAMPLING_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "temperature": number,
    "top_p": number,
    "top_k": top_k,
    "min_p": number,
    "repetition_penalty": number,
    "presence_penalty": number,
    "frequency_penalty": number,
    "logit_bias": logit_bias,
    "seed": integer,
    "ignore_eos": boolean,
    "stop_token_ids": token_ids,
    "min_tokens": integer,
    "allowed_token_ids": token_ids,
    "prompt_logprobs": integer,  # vLLM's
    "logprobs_mode": string,  # specray's: "raw" or "processed", per request
}
COMMON_FIELDS = {"model", "n", "stop", "stream", "stream_options", "user", "max_tokens"}
# OpenAI fields about storage, billing, caching or routing: they change nothing generated.
IGNORED_FIELDS = {
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "prediction",
}
VLLM_FIELDS = {"include_stop_str_in_output", *STRUCTURED_FIELDS}
SPECRAY_FIELDS = {"num_speculative_tokens", "speculation", "timeout"}
COMPLETION_FIELDS = {"prompt", "echo", "logprobs", "best_of", "suffix", "response_format"}
CHAT_FIELDS = {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}


def _check_fields(body: Mapping, endpoint_fields: set[str]) -> None:
    known = (
        COMMON_FIELDS
        | IGNORED_FIELDS
        | VLLM_FIELDS
        | SPECRAY_FIELDS
        | endpoint_fields
        | set(SAMPLING_FIELDS)
    )
    unknown = sorted(set(body) - known)
    if unknown:
        raise invalid(unknown[0], f"unknown parameter {unknown[0]!r}")


def _reject_if(condition: bool, name: str, value: Any, allowed: str) -> None:
    if condition:
        raise invalid(name, f"{name}={show(value)} is not supported; {allowed}")


# ---- one API call ------------------------------------------------------------------------
@dataclass(frozen=True)
class ApiCall:
    """A parsed completions or chat call: one :class:`GenerateRequest` per choice."""

    chat: bool
    id: str
    created: int  # Unix seconds
    model: str
    requests: tuple  # GenerateRequest per choice, in choice-index order
    n: int  # choices per prompt
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    logprobs: int | None = None  # most likely tokens shown per position; None: no logprobs
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field; None: not asked
    echo: bool = False  # completions: the prompt leads each choice (and its logprobs)
    tools: ToolCalling | None = None  # chat: the call's tools and tool_choice

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


def _model(body: Mapping, served_model: str) -> str:
    model = body.get("model")
    if model is None:  # as vLLM: the served model
        return served_model
    if not isinstance(model, str) or not model:
        raise invalid("model", f"model must be the served model's name, got {show(model)}")
    if model != served_model:
        raise HttpError(
            404,
            f"the model {model!r} does not exist; this server serves {served_model!r}",
            param="model",
            code="model_not_found",
        )
    return model


def _streaming(body: Mapping) -> tuple[bool, bool]:
    stream = body.get("stream")
    stream = False if stream is None else boolean("stream", stream)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise invalid(
            "stream_options",
            f"stream_options must be {{include_usage: bool}}, got {show(options)}",
        )
    include = options.get("include_usage")
    return stream, False if include is None else boolean("stream_options.include_usage", include)


def _speculation(body: Mapping) -> tuple[int | None, str]:
    """``num_speculative_tokens`` (k cap) and ``speculation`` ("auto", "on", "off"); their
    agreement is checked by GenerateRequest."""
    k = body.get("num_speculative_tokens")
    if k is not None and (not is_int(k) or k < 0):
        raise invalid(
            "num_speculative_tokens", f"num_speculative_tokens must be an integer >= 0, got {k!r}"
        )
    mode = body.get("speculation")
    if mode is None:
        return k, "auto"
    if mode not in SPECULATION_MODES:
        raise invalid(
            "speculation",
            f"speculation must be one of {list(SPECULATION_MODES)}, got {show(mode)}",
        )
    return k, mode


def _sampling(body: Mapping, max_tokens_field: str | None) -> dict:
    params = {
        name: check(name, body[name])
        for name, check in SAMPLING_FIELDS.items()
        if body.get(name) is not None
    }
    if max_tokens_field is not None:
        params["max_tokens"] = integer(max_tokens_field, body[max_tokens_field])
    return params


def _choice_count(body: Mapping, num_prompts: int) -> int:
    n = body.get("n")
    n = 1 if n is None else integer("n", n)
    if n < 1:
        raise invalid("n", f"n must be >= 1, got {n}")
    if n * num_prompts > MAX_CHOICES:
        raise invalid(
            "n", f"{num_prompts} prompt(s) x n={n} choices exceeds the limit of {MAX_CHOICES}"
        )
    return n


def _stop(value: Any) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid("stop", f"stop must be a string or a list of strings, got {show(value)}")
    return tuple(value)  # emptiness and count: checked by GenerateRequest


def _build(
    body: Mapping,
    *,
    chat: bool,
    model: str,
    prompts: Sequence[dict],
    params: dict,
    echo: bool = False,
    tools: ToolCalling | None = None,
) -> ApiCall:
    """One GenerateRequest per prompt x choice; ``prompts`` hold GenerateRequest fields."""
    stream, include_usage = _streaming(body)
    if stream and body.get("prompt_logprobs") is not None:  # vLLM's rule: no chunk has room
        raise invalid("prompt_logprobs", "prompt_logprobs is not available with stream=true")
    n = _choice_count(body, len(prompts))
    k, speculation = _speculation(body)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user", f"user must be a string, got {show(user)}")
    stop = _stop(body.get("stop"))
    include_stop = body.get("include_stop_str_in_output")
    include_stop = include_stop is not None and boolean("include_stop_str_in_output", include_stop)
    timeout_s = body.get("timeout")
    if timeout_s is not None and not 0 < number("timeout", timeout_s) < math.inf:
        raise invalid("timeout", f"timeout must be > 0 seconds, got {show(timeout_s)}")
    call_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    single = len(prompts) * n == 1
    requests = []
    for prompt in prompts:
        for choice in range(n):
            index = len(requests)
            choice_params = dict(params)
            if "seed" in params:
                choice_params["seed"] = params["seed"] + choice
            requests.append(
                GenerateRequest(
                    **prompt,
                    params=choice_params,
                    stop=stop,
                    include_stop_str_in_output=include_stop,
                    num_speculative_tokens=k,
                    speculation=speculation,
                    request_id=call_id if single else f"{call_id}-{index}",
                    timeout_s=timeout_s,
                    stream=stream,
                )
            )
    return ApiCall(
        chat=chat,
        id=call_id,
        created=int(time.time()),
        model=model,
        requests=tuple(requests),
        n=n,
        stream=stream,
        include_usage=include_usage,
        logprobs=params.get("logprobs"),
        prompt_logprobs=body.get("prompt_logprobs"),
        echo=echo,
        tools=tools,
    )


def _has_unencodable(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` holds a string (or key) that is not valid UTF-8: JSON may escape lone
    surrogates (``"\\ud800"``), which the tokenizer and the response encoder cannot take."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if depth > 64:  # read_json bounds nesting already; this only guards the recursion
        return False
    if isinstance(value, dict):
        return any(
            _has_unencodable(k, depth + 1) or _has_unencodable(v, depth + 1)
            for k, v in value.items()
        )
    if isinstance(value, list):
        return any(_has_unencodable(item, depth + 1) for item in value)
    return False


def _check_utf8(body: Mapping) -> None:
    for key, value in body.items():
        if _has_unencodable(key):
            raise invalid(None, f"the field name {key!a} is not valid UTF-8 text")
        if _has_unencodable(value):
            raise invalid(key, f"{key} holds text that is not valid UTF-8 (a lone surrogate)")


def _start(body: Any, served_model: str, endpoint_fields: set[str]) -> tuple[Mapping, str]:
    """The checks every call begins with: a JSON object, valid UTF-8 text, the served model,
    known fields."""
    if not isinstance(body, dict):
        raise invalid(None, f"the request body must be a JSON object, got {show(body)}")
    _check_utf8(body)
    model = _model(body, served_model)
    _check_fields(body, endpoint_fields)
    return body, model


# ---- completions -------------------------------------------------------------------------
def _prompts(value: Any) -> list[dict]:
    """A string, a list of token ids, or a batch of either -> GenerateRequest prompt fields."""

    def wrong() -> InvalidRequestError:
        return invalid(
            "prompt",
            "prompt must be a string, a list of token ids, or a list of strings or of token-id "
            f"lists, got {show(value)}",
        )

    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, list):
        raise wrong()
    elif value and all(is_int(v) for v in value):
        value = [value]
    if not value:
        raise invalid("prompt", "prompt must not be empty")
    prompts = []
    for index, item in enumerate(value):
        if isinstance(item, str):
            prompts.append({"prompt": item})
        elif isinstance(item, list) and all(is_int(v) for v in item):
            prompts.append({"prompt_token_ids": tuple(item)})
        else:
            raise wrong()
        if not item:
            where = "prompt" if len(value) == 1 else f"prompt[{index}]"
            raise invalid("prompt", f"{where} must not be empty")
    return prompts


def parse_completion(body: Any, served_model: str) -> ApiCall:
    """``POST /v1/completions`` body -> :class:`ApiCall` (raises InvalidRequestError /
    HttpError naming the parameter)."""
    body, model = _start(body, served_model, COMPLETION_FIELDS)
    echo = body.get("echo")
    echo = echo is not None and boolean("echo", echo)
    _reject_if(body.get("suffix") is not None, "suffix", body.get("suffix"), "omit it")
    best_of = body.get("best_of")
    _reject_if(best_of not in (None, 1), "best_of", best_of, "only 1 (or null) is")
    if "prompt" not in body:
        raise invalid("prompt", "prompt is required")
    prompts = _prompts(body["prompt"])
    params = _sampling(body, "max_tokens" if body.get("max_tokens") is not None else None)
    params.setdefault("max_tokens", 16)  # OpenAI's completions default
    _constrained(params, output_constraint(body))
    if body.get("logprobs") is not None:
        params["logprobs"] = integer("logprobs", body["logprobs"])
        if echo:  # the prompt's tokens lead the lists: scored with as many (vLLM's default)
            params.setdefault("prompt_logprobs", params["logprobs"])
    return _build(body, chat=False, model=model, prompts=prompts, params=params, echo=echo)


def _constrained(params: dict, constraint: Constraint | None) -> dict:
    """``params`` with the output's grammar; the options a grammar is not combined with are
    refused naming the field that asked for it."""
    if constraint is not None:
        check_grammar_params(params, constraint.field)
        params["structured_outputs"] = constraint.structured_outputs
    return params


# ---- chat completions --------------------------------------------------------------------
def parse_chat(body: Any, served_model: str) -> ApiCall:
    """``POST /v1/chat/completions`` body -> :class:`ApiCall`. Without ``max_tokens`` /
    ``max_completion_tokens`` the backend's default length applies."""
    body, model = _start(body, served_model, CHAT_FIELDS)
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    logprobs = logprobs is not None and boolean("logprobs", logprobs)
    if top is not None:
        if not 0 <= integer("top_logprobs", top) <= MAX_TOP_LOGPROBS:
            message = f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}"
            raise invalid("top_logprobs", message)
        if not logprobs:
            raise invalid("top_logprobs", f"top_logprobs={top} needs logprobs: true")
    if "messages" not in body:
        raise invalid("messages", "messages is required")
    prompt = {"messages": tuple(check_messages(body["messages"]))}
    tools = tool_calling(body)
    constraint = output_constraint(body)
    if tools is not None:
        prompt |= {"tools": tools.tools, "tool_choice": tools.mode}
        if tools.constraint is not None and constraint is not None:
            raise invalid(
                constraint.field,
                f"tool_choice={show(body.get('tool_choice'))} makes the output a tool call; "
                f"{constraint.field} cannot constrain it too",
            )
        constraint = tools.constraint or constraint
    # max_completion_tokens supersedes the deprecated max_tokens (OpenAI); either is accepted.
    length_field = next(
        (f for f in ("max_completion_tokens", "max_tokens") if body.get(f) is not None), None
    )
    params = _constrained(_sampling(body, length_field), constraint)
    if logprobs:
        params["logprobs"] = top or 0
    return _build(body, chat=True, model=model, prompts=[prompt], params=params, tools=tools)


# ---- tokenizer endpoints (vLLM's) --------------------------------------------------------
def parse_tokenize(body: Any, served_model: str) -> GenerateRequest:
    """``POST /tokenize``: ``prompt`` (text, no chat template) or ``messages`` (rendered as
    ``/v1/chat/completions`` renders them) -> the request whose prompt ids to return."""
    body, _ = _start(body, served_model, {"prompt", "messages"})
    if ("prompt" in body) == ("messages" in body):
        raise invalid("prompt", "send exactly one of prompt (text) or messages")
    if "messages" in body:
        return GenerateRequest(messages=tuple(check_messages(body["messages"])))
    prompt = body["prompt"]
    if not isinstance(prompt, str) or not prompt:
        raise invalid("prompt", f"prompt must be a non-empty string, got {show(prompt)}")
    return GenerateRequest(prompt=prompt)


def parse_detokenize(body: Any, served_model: str) -> list[int]:
    """``POST /detokenize``: ``tokens``, a list of token ids."""
    body, _ = _start(body, served_model, {"tokens"})
    if "tokens" not in body:
        raise invalid("tokens", "tokens is required")
    return token_ids("tokens", body["tokens"])
