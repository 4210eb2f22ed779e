"""The contract between the public front ends (OpenAI HTTP, gRPC) and whatever generates.

Front ends turn their wire format into a :class:`GenerateRequest` and consume the events of
:meth:`GenerationBackend.generate`; backends are the in-process coordinator service
(:mod:`specray.serve.service`) or the Ray Serve ``Coordinator`` deployment seen through its
handle. Events are plain dicts (they cross Ray and are msgpack-friendly):

- ``{"kind": "delta", "text": str, "token_ids": [int], "logprobs", "prompt_logprobs"}``: newly
  committed tokens and the text they complete (text may lag a token while a multi-byte
  character is incomplete); ``logprobs`` one entry per token when the request's params ask
  (``logprobs``), else None; ``prompt_logprobs`` one entry per prompt token on the first delta
  with tokens when they ask (``prompt_logprobs``), else None;
- ``{"kind": "final", "request_id", "text", "token_ids", "finish_reason", "prompt_tokens",
  "completion_tokens", "seed", "speculative_decoding": {...}, "time_to_first_token_s",
  "latency_s", "logprobs", "prompt_logprobs"}``: exactly one, last; ``text`` / ``token_ids`` /
  ``logprobs`` are the whole output (the deltas' concatenated), ``prompt_logprobs`` the
  prompt's; after a stop string the tokens end with the one that completed it (as vLLM's);
- an error is raised as a :class:`specray.errors.SpecrayError`, before or between deltas.

A log-probability entry is ``{"token_id", "token", "logprob", "rank", "top"}``: the token's text
decoded on its own, its log-probability (-inf where the processed distribution excludes it),
its rank (1 + the tokens strictly more likely) and ``top``, the most likely first, each
``{"token_id", "token", "logprob"}``, as many as asked. The first prompt token's entry has
``logprob`` and ``rank`` None and no ``top`` (nothing precedes it).

No torch here: the client library and the front ends import this module.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from specray.errors import InvalidRequestError

MAX_STOP_STRINGS = 16  # as OpenAI's API caps ``stop`` (4) and vLLM does not: a sane bound
CHAT_ROLES = ("system", "user", "assistant", "tool")
SPECULATION_MODES = ("auto", "on", "off")
# A chat call's tool_choice, as the service sees it ("named": a function is named).
TOOL_CHOICE_MODES = ("none", "auto", "required", "named")
# Roles other APIs name that mean one of ours: OpenAI's "developer" instructions are the system
# turn of models without a developer role in their chat template (as vLLM maps them).
ROLE_ALIASES = {"developer": "system"}


@dataclass(frozen=True)
class GenerateRequest:
    """One generation, as every front end hands it to a backend.

    Exactly one of ``prompt`` (text), ``prompt_token_ids`` or ``messages`` (chat turns,
    rendered with the model's chat template) is set. ``params`` holds
    :class:`specray.sampling.SamplingParams` fields, validated where the tokenizer is.
    """

    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[Mapping[str, str], ...] | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    stop: tuple[str, ...] = ()  # stop strings: the output ends before the first one ...
    include_stop_str_in_output: bool = False  # ... or right after it (vLLM's option)
    num_speculative_tokens: int | None = None  # this request's largest k; 0 = speculation off
    # "auto": the server's policy picks k each round; "on": the largest k every round; "off"
    speculation: str = "auto"
    request_id: str | None = None
    timeout_s: float | None = None  # the deadline, from now
    # Output tokens already committed and delivered to the caller: the ingress resumes a request
    # whose coordinator or target group failed from them (internal; no public API sets it).
    resume_token_ids: tuple[int, ...] = ()
    # False: the caller takes the whole output at the end (a non-streamed completion), so the
    # engine core need not send every round's tokens (stop strings still stream: they are
    # matched here, at the front end).
    stream: bool = True
    # Chat: OpenAI tool objects, rendered by the chat template where it renders tools, and
    # the call's tool_choice (TOOL_CHOICE_MODES): "auto" needs such a template (the model
    # decides), the others constrain the output through params or not at all.
    tools: tuple[Mapping[str, Any], ...] = ()
    tool_choice: str = "none"

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("prompt", "prompt_token_ids", "messages")
            if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise InvalidRequestError(
                f"exactly one of prompt, prompt_token_ids or messages must be given, got {given}",
                param="prompt",
            )
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise InvalidRequestError(
                f"prompt must be a string, got {self.prompt!r}", param="prompt"
            )
        if self.prompt_token_ids is not None:
            ids = self.prompt_token_ids
            if isinstance(ids, (str, bytes)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise InvalidRequestError(
                    f"prompt token ids must be integers, got {ids!r}", param="prompt"
                )
            object.__setattr__(self, "prompt_token_ids", tuple(ids))
        if self.messages is not None:
            object.__setattr__(self, "messages", tuple(check_messages(self.messages)))
        if self.speculation not in SPECULATION_MODES:
            raise InvalidRequestError(
                f"speculation must be one of {list(SPECULATION_MODES)}, got {self.speculation!r}",
                param="speculation",
            )
        if self.speculation == "off":
            if self.num_speculative_tokens:
                raise InvalidRequestError(
                    f"num_speculative_tokens={self.num_speculative_tokens} contradicts "
                    "speculation='off'",
                    param="num_speculative_tokens",
                )
            object.__setattr__(self, "num_speculative_tokens", 0)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise InvalidRequestError(
                "include_stop_str_in_output must be true or false, got "
                f"{self.include_stop_str_in_output!r}",
                param="include_stop_str_in_output",
            )
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not all(isinstance(s, str) and s for s in stop):
            raise InvalidRequestError(
                f"stop must be a non-empty string or a list of them, got {self.stop!r}",
                param="stop",
            )
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS}", param="stop"
            )
        object.__setattr__(self, "stop", tuple(stop))
        k = self.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise InvalidRequestError(
                f"num_speculative_tokens must be an integer >= 0, got {k!r}",
                param="num_speculative_tokens",
            )
        if self.request_id is not None and (
            not isinstance(self.request_id, str) or not self.request_id
        ):
            raise InvalidRequestError(
                f"request_id must be a non-empty string, got {self.request_id!r}",
                param="request_id",
            )
        timeout = self.timeout_s
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
        ):
            raise InvalidRequestError(
                f"timeout must be > 0 seconds, got {timeout!r}", param="timeout"
            )
        if not isinstance(self.params, Mapping):
            raise InvalidRequestError(f"params must be a mapping, got {self.params!r}")
        resume = self.resume_token_ids
        if isinstance(resume, (str, bytes)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in resume
        ):
            raise InvalidRequestError(f"resume token ids must be integers >= 0, got {resume!r}")
        object.__setattr__(self, "resume_token_ids", tuple(resume))
        if not isinstance(self.stream, bool):
            raise InvalidRequestError(
                f"stream must be true or false, got {self.stream!r}", param="stream"
            )
        if isinstance(self.tools, (str, bytes, Mapping)) or not all(
            isinstance(tool, Mapping) for tool in self.tools
        ):
            raise InvalidRequestError(
                f"tools must be tool objects, got {self.tools!r}", param="tools"
            )
        object.__setattr__(self, "tools", tuple(self.tools))
        if self.tools and self.messages is None:
            raise InvalidRequestError("tools are for chat messages only", param="tools")
        if self.tool_choice not in TOOL_CHOICE_MODES:
            raise InvalidRequestError(
                f"tool_choice must be one of {list(TOOL_CHOICE_MODES)}, got {self.tool_choice!r}",
                param="tool_choice",
            )

    def to_dict(self) -> dict:
        """Plain values only (crosses Ray without pickling specray classes)."""
        return {
            "prompt": self.prompt,
            "prompt_token_ids": list(self.prompt_token_ids)
            if self.prompt_token_ids is not None
            else None,
            "messages": [dict(m) for m in self.messages] if self.messages is not None else None,
            "params": dict(self.params),
            "stop": list(self.stop),
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "num_speculative_tokens": self.num_speculative_tokens,
            "speculation": self.speculation,
            "request_id": self.request_id,
            "timeout_s": self.timeout_s,
            "resume_token_ids": list(self.resume_token_ids),
            "stream": self.stream,
            "tools": [dict(tool) for tool in self.tools],
            "tool_choice": self.tool_choice,
        }

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> GenerateRequest:
        values = dict(values)
        for name in ("prompt_token_ids", "messages", "stop", "resume_token_ids", "tools"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        return cls(**values)


# Sampling options a grammar (structured outputs, a tool choice) is not combined with: they
# hold off (min_tokens, ignore_eos) the end-of-sequence token that is all a complete grammar
# allows, or take tokens away at every position (allowed / banned ids), so that the grammar's
# mask and theirs may leave no token to draw.
GRAMMAR_EXCLUSIVE_PARAMS = ("min_tokens", "ignore_eos", "allowed_token_ids", "banned_token_ids")
MAX_SHOWN_CHARS = 60  # of a value quoted in an error


def check_grammar_params(params: Mapping[str, Any], grammar: str) -> None:
    """An InvalidRequestError naming the first of GRAMMAR_EXCLUSIVE_PARAMS set in ``params``
    together with ``grammar`` (the request field that asked for one)."""
    for name in GRAMMAR_EXCLUSIVE_PARAMS:
        value = params.get(name)
        if value:
            shown = repr(value)
            if len(shown) > MAX_SHOWN_CHARS:
                shown = shown[: MAX_SHOWN_CHARS - 3] + "..."
            raise InvalidRequestError(
                f"{name}={shown} cannot be combined with {grammar}: with a grammar it may leave "
                "no token to draw (a complete grammar allows only the end-of-sequence token)",
                param=name,
            )


def check_messages(messages) -> list[dict[str, str]]:
    """Chat turns: a non-empty list of ``{"role", "content"}`` with a known role; content is a
    string or a list of ``{"type": "text", "text": ...}`` parts (joined). A tool-using
    conversation as OpenAI's clients send it back: an assistant turn may carry ``tool_calls``
    (its content then may be null), a ``tool`` turn answers one (``tool_call_id``); both go
    to the chat template, each call's ``arguments`` as an object (templates render them so;
    OpenAI sends a JSON string)."""
    if isinstance(messages, (str, bytes, Mapping)) or not hasattr(messages, "__iter__"):
        raise InvalidRequestError(
            f"messages must be a list of {{role, content}} objects, got {messages!r}",
            param="messages",
        )
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(
                f"messages[{index}] must be an object, got {message!r}", param="messages"
            )
        role, content = message.get("role"), message.get("content")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{index}].role must be one of {[*CHAT_ROLES, *ROLE_ALIASES]}, "
                f"got {role!r}",
                param="messages",
            )
        turn = {}
        if role == "assistant" and message.get("tool_calls") is not None:
            turn["tool_calls"] = _tool_calls(index, message["tool_calls"])
            if content is None:
                content = ""
        if role == "tool" and message.get("tool_call_id") is not None:
            if not isinstance(message["tool_call_id"], str):
                raise InvalidRequestError(
                    f"messages[{index}].tool_call_id must be a string, "
                    f"got {message['tool_call_id']!r}",
                    param="messages",
                )
            turn["tool_call_id"] = message["tool_call_id"]
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (
                    isinstance(part, Mapping)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise InvalidRequestError(
                        f"messages[{index}].content parts must be {{type: text, text}}, "
                        f"got {part!r}",
                        param="messages",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise InvalidRequestError(
                f"messages[{index}].content must be a string, got {content!r}",
                param="messages",
            )
        checked.append({"role": role, "content": content, **turn})
    if not checked:
        raise InvalidRequestError("messages must not be empty", param="messages")
    return checked


def _tool_calls(index: int, calls) -> list[dict]:
    """An assistant turn's ``tool_calls``: ``[{"id", "type": "function", "function": {"name",
    "arguments"}}]``, arguments a JSON object (or its text)."""
    where = f"messages[{index}].tool_calls"
    if isinstance(calls, (str, bytes, Mapping)) or not hasattr(calls, "__iter__"):
        raise InvalidRequestError(f"{where} must be a list, got {calls!r}", param="messages")
    checked = []
    for position, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or call.get("type", "function") != "function":
            raise InvalidRequestError(
                f"{where}[{position}] must be {{type: function, function: {{name, arguments}}}}, "
                f"got {call!r}",
                param="messages",
            )
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                arguments = None
        if not isinstance(arguments, Mapping):
            raise InvalidRequestError(
                f"{where}[{position}].function.arguments must be a JSON object, "
                f"got {function.get('arguments')!r}",
                param="messages",
            )
        entry = {"type": "function", "function": {"name": name, "arguments": dict(arguments)}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        checked.append(entry)
    return checked


class GenerationBackend(Protocol):
    """What the front ends call. Errors are :class:`specray.errors.SpecrayError`."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[dict]:
        """Events of one request (see the module docstring). Closing the iterator early
        (the caller went away) aborts the request and frees its worker state."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Cancel a request by id; False when no such request is in flight here."""
        ...

    async def model_info(self) -> dict:
        """``model`` (served name), ``max_model_len``, ``vocab_size``, ``draft``,
        ``num_speculative_tokens``, ``eos_token_ids``."""
        ...

    async def tokenize(self, request: GenerateRequest) -> list[int]:
        """The prompt token ids ``generate`` would run (``/tokenize``)."""
        ...

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (``/detokenize``); ids outside the vocabulary are an
        InvalidRequestError naming ``tokens``."""
        ...

    async def health(self) -> bool:
        """True while serving; False when draining or a required part is down."""
        ...

    async def metrics_text(self) -> bytes:
        """Prometheus exposition text of the serving metrics."""
        ...
