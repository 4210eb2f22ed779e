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
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specray.errors import InvalidRequestError, SpecrayError
from specray.serve.protocol import SPECULATION_MODES, GenerateRequest, check_messages

MAX_CHOICES = 128  # prompts x n in one call (OpenAI caps n at 128)
MAX_SHOWN_CHARS = 80  # of a rejected value, quoted in an error message
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


# ---- field checks ------------------------------------------------------------------------
def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."


def _invalid(param: str | None, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(name, f"{name} must be a number, got {_show(value)}")
    try:
        # A float from here on: an int past float's range must not overflow further in.
        return float(value)
    except OverflowError:
        raise _invalid(name, f"{name} must be a finite number, got a huge integer") from None


def _integer(name: str, value: Any) -> int:
    if not _is_int(value):
        raise _invalid(name, f"{name} must be an integer, got {_show(value)}")
    return value


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _invalid(name, f"{name} must be true or false, got {_show(value)}")
    return value


def _token_ids(name: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise _invalid(name, f"{name} must be a list of integer token ids, got {_show(value)}")
    return value


def _logit_bias(name: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise _invalid(name, f"{name} must be an object of token id -> bias, got {_show(value)}")
    return value


def _string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _invalid(name, f"{name} must be a string, got {_show(value)}")
    return value


def _top_k(name: str, value: Any) -> int:
    # vLLM spells "off" -1; SamplingParams spells it 0.
    return 0 if _integer(name, value) == -1 else value


# OpenAI / vLLM field -> its check; the checked value goes to SamplingParams under that name.
SAMPLING_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "temperature": _number,
    "top_p": _number,
    "top_k": _top_k,
    "min_p": _number,
    "repetition_penalty": _number,
    "presence_penalty": _number,
    "frequency_penalty": _number,
    "logit_bias": _logit_bias,
    "seed": _integer,
    "ignore_eos": _boolean,
    "stop_token_ids": _token_ids,
    "min_tokens": _integer,
    "allowed_token_ids": _token_ids,
    "prompt_logprobs": _integer,  # vLLM's
    "logprobs_mode": _string,  # specray's: "raw" or "processed", per request
}
COMMON_FIELDS = {"model", "n", "stop", "stream", "stream_options", "user", "max_tokens"}
# OpenAI fields about storage, billing, caching or routing: they change nothing generated.
IGNORED_FIELDS = {
    "store",
    "metadata",
    "service_tier",
    "parallel_tool_calls",
    "prompt_cache_key",
    "safety_identifier",
    "prediction",
}
VLLM_FIELDS = {"include_stop_str_in_output"}
SPECRAY_FIELDS = {"num_speculative_tokens", "speculation", "timeout"}
COMPLETION_FIELDS = {"prompt", "echo", "logprobs", "best_of", "suffix"}
CHAT_FIELDS = {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
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
        raise _invalid(unknown[0], f"unknown parameter {unknown[0]!r}")


def _reject_if(condition: bool, name: str, value: Any, allowed: str) -> None:
    if condition:
        raise _invalid(name, f"{name}={_show(value)} is not supported; {allowed}")


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

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


def _model(body: Mapping, served_model: str) -> str:
    model = body.get("model")
    if model is None:  # as vLLM: the served model
        return served_model
    if not isinstance(model, str) or not model:
        raise _invalid("model", f"model must be the served model's name, got {_show(model)}")
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
    stream = False if stream is None else _boolean("stream", stream)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise _invalid("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise _invalid(
            "stream_options",
            f"stream_options must be {{include_usage: bool}}, got {_show(options)}",
        )
    include = options.get("include_usage")
    return stream, False if include is None else _boolean("stream_options.include_usage", include)


def _speculation(body: Mapping) -> tuple[int | None, str]:
    """``num_speculative_tokens`` (k cap) and ``speculation`` ("auto", "on", "off"); their
    agreement is checked by GenerateRequest."""
    k = body.get("num_speculative_tokens")
    if k is not None and (not _is_int(k) or k < 0):
        raise _invalid(
            "num_speculative_tokens", f"num_speculative_tokens must be an integer >= 0, got {k!r}"
        )
    mode = body.get("speculation")
    if mode is None:
        return k, "auto"
    if mode not in SPECULATION_MODES:
        raise _invalid(
            "speculation",
            f"speculation must be one of {list(SPECULATION_MODES)}, got {_show(mode)}",
        )
    return k, mode


def _sampling(body: Mapping, max_tokens_field: str | None) -> dict:
    params = {
        name: check(name, body[name])
        for name, check in SAMPLING_FIELDS.items()
        if body.get(name) is not None
    }
    if max_tokens_field is not None:
        params["max_tokens"] = _integer(max_tokens_field, body[max_tokens_field])
    return params


def _choice_count(body: Mapping, num_prompts: int) -> int:
    n = body.get("n")
    n = 1 if n is None else _integer("n", n)
    if n < 1:
        raise _invalid("n", f"n must be >= 1, got {n}")
    if n * num_prompts > MAX_CHOICES:
        raise _invalid(
            "n", f"{num_prompts} prompt(s) x n={n} choices exceeds the limit of {MAX_CHOICES}"
        )
    return n


def _stop(value: Any) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _invalid("stop", f"stop must be a string or a list of strings, got {_show(value)}")
    return tuple(value)  # emptiness and count: checked by GenerateRequest


def _build(
    body: Mapping,
    *,
    chat: bool,
    model: str,
    prompts: Sequence[dict],
    params: dict,
    echo: bool = False,
) -> ApiCall:
    """One GenerateRequest per prompt x choice; ``prompts`` hold GenerateRequest fields."""
    stream, include_usage = _streaming(body)
    if stream and body.get("prompt_logprobs") is not None:  # vLLM's rule: no chunk has room
        raise _invalid("prompt_logprobs", "prompt_logprobs is not available with stream=true")
    n = _choice_count(body, len(prompts))
    k, speculation = _speculation(body)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _invalid("user", f"user must be a string, got {_show(user)}")
    stop = _stop(body.get("stop"))
    include_stop = body.get("include_stop_str_in_output")
    include_stop = include_stop is not None and _boolean("include_stop_str_in_output", include_stop)
    timeout_s = body.get("timeout")
    if timeout_s is not None and not 0 < _number("timeout", timeout_s) < math.inf:
        raise _invalid("timeout", f"timeout must be > 0 seconds, got {_show(timeout_s)}")
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
            raise _invalid(None, f"the field name {key!a} is not valid UTF-8 text")
        if _has_unencodable(value):
            raise _invalid(key, f"{key} holds text that is not valid UTF-8 (a lone surrogate)")


def _start(body: Any, served_model: str, endpoint_fields: set[str]) -> tuple[Mapping, str]:
    """The checks every call begins with: a JSON object, valid UTF-8 text, the served model,
    known fields."""
    if not isinstance(body, dict):
        raise _invalid(None, f"the request body must be a JSON object, got {_show(body)}")
    _check_utf8(body)
    model = _model(body, served_model)
    _check_fields(body, endpoint_fields)
    return body, model


# ---- completions -------------------------------------------------------------------------
def _prompts(value: Any) -> list[dict]:
    """A string, a list of token ids, or a batch of either -> GenerateRequest prompt fields."""

    def wrong() -> InvalidRequestError:
        return _invalid(
            "prompt",
            "prompt must be a string, a list of token ids, or a list of strings or of token-id "
            f"lists, got {_show(value)}",
        )

    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, list):
        raise wrong()
    elif value and all(_is_int(v) for v in value):
        value = [value]
    if not value:
        raise _invalid("prompt", "prompt must not be empty")
    prompts = []
    for index, item in enumerate(value):
        if isinstance(item, str):
            prompts.append({"prompt": item})
        elif isinstance(item, list) and all(_is_int(v) for v in item):
            prompts.append({"prompt_token_ids": tuple(item)})
        else:
            raise wrong()
        if not item:
            where = "prompt" if len(value) == 1 else f"prompt[{index}]"
            raise _invalid("prompt", f"{where} must not be empty")
    return prompts


def parse_completion(body: Any, served_model: str) -> ApiCall:
    """``POST /v1/completions`` body -> :class:`ApiCall` (raises InvalidRequestError /
    HttpError naming the parameter)."""
    body, model = _start(body, served_model, COMPLETION_FIELDS)
    echo = body.get("echo")
    echo = echo is not None and _boolean("echo", echo)
    _reject_if(body.get("suffix") is not None, "suffix", body.get("suffix"), "omit it")
    best_of = body.get("best_of")
    _reject_if(best_of not in (None, 1), "best_of", best_of, "only 1 (or null) is")
    if "prompt" not in body:
        raise _invalid("prompt", "prompt is required")
    prompts = _prompts(body["prompt"])
    params = _sampling(body, "max_tokens" if body.get("max_tokens") is not None else None)
    params.setdefault("max_tokens", 16)  # OpenAI's completions default
    if body.get("logprobs") is not None:
        params["logprobs"] = _integer("logprobs", body["logprobs"])
        if echo:  # the prompt's tokens lead the lists: scored with as many (vLLM's default)
            params.setdefault("prompt_logprobs", params["logprobs"])
    return _build(body, chat=False, model=model, prompts=prompts, params=params, echo=echo)


def _check_plain_text_output(body: Mapping) -> None:
    """What SDKs send for plain text is accepted: ``response_format`` ``{"type": "text"}``,
    ``tools: []``, ``tool_choice`` "none" (or "auto" without tools). Structured outputs and
    tool calls are refused by name until they are served."""
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        _reject_if(
            kind != "text" or set(response_format) != {"type"},
            "response_format",
            response_format,
            'only {"type": "text"} is served (structured outputs are not yet)',
        )
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _invalid("tools", f"tools must be a list, got {_show(tools)}")
    _reject_if(bool(tools), "tools", tools, "tool calls are not served yet: send [] or omit it")
    choice = body.get("tool_choice")
    _reject_if(
        choice not in (None, "none", "auto"),
        "tool_choice",
        choice,
        'without tools only "none" or "auto" mean anything',
    )


# ---- chat completions --------------------------------------------------------------------
def parse_chat(body: Any, served_model: str) -> ApiCall:
    """``POST /v1/chat/completions`` body -> :class:`ApiCall`. Without ``max_tokens`` /
    ``max_completion_tokens`` the backend's default length applies."""
    body, model = _start(body, served_model, CHAT_FIELDS)
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    logprobs = logprobs is not None and _boolean("logprobs", logprobs)
    if top is not None:
        if not 0 <= _integer("top_logprobs", top) <= MAX_TOP_LOGPROBS:
            message = f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}"
            raise _invalid("top_logprobs", message)
        if not logprobs:
            raise _invalid("top_logprobs", f"top_logprobs={top} needs logprobs: true")
    _check_plain_text_output(body)
    if "messages" not in body:
        raise _invalid("messages", "messages is required")
    prompts = [{"messages": tuple(check_messages(body["messages"]))}]
    # max_completion_tokens supersedes the deprecated max_tokens (OpenAI); either is accepted.
    length_field = next(
        (f for f in ("max_completion_tokens", "max_tokens") if body.get(f) is not None), None
    )
    params = _sampling(body, length_field)
    if logprobs:
        params["logprobs"] = top or 0
    return _build(body, chat=True, model=model, prompts=prompts, params=params)


# ---- tokenizer endpoints (vLLM's) --------------------------------------------------------
def parse_tokenize(body: Any, served_model: str) -> GenerateRequest:
    """``POST /tokenize``: ``prompt`` (text, no chat template) or ``messages`` (rendered as
    ``/v1/chat/completions`` renders them) -> the request whose prompt ids to return."""
    body, _ = _start(body, served_model, {"prompt", "messages"})
    if ("prompt" in body) == ("messages" in body):
        raise _invalid("prompt", "send exactly one of prompt (text) or messages")
    if "messages" in body:
        return GenerateRequest(messages=tuple(check_messages(body["messages"])))
    prompt = body["prompt"]
    if not isinstance(prompt, str) or not prompt:
        raise _invalid("prompt", f"prompt must be a non-empty string, got {_show(prompt)}")
    return GenerateRequest(prompt=prompt)


def parse_detokenize(body: Any, served_model: str) -> list[int]:
    """``POST /detokenize``: ``tokens``, a list of token ids."""
    body, _ = _start(body, served_model, {"tokens"})
    if "tokens" not in body:
        raise _invalid("tokens", "tokens is required")
    return _token_ids("tokens", body["tokens"])
