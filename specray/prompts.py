"""Prompts to token ids: the one place a text prompt or chat turns become what a model reads.

The offline engine, the served API, the benchmarks and distillation all encode here, so the
same prompt gives the same ids on every path (an offline run and a served request agree token
for token). No torch and no Ray: a tokenizer is all it needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from specray.errors import InvalidRequestError


def user_turn(text: str) -> list[dict[str, str]]:
    """A text prompt as chat turns: one user message, the form an instruct model answers."""
    return [{"role": "user", "content": text}]


PROBE_TOOL_NAME = "specray_probe_tool"  # a tool only template_renders_tools shows a template


def template_renders_tools(tokenizer) -> bool:
    """Whether ``tokenizer``'s chat template shows the model the ``tools`` it is given: a
    conversation rendered with a probe tool holds the tool's name (SmolLM2's template, for one,
    ignores tools)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    probe = {
        "type": "function",
        "function": {
            "name": PROBE_TOOL_NAME,
            "description": "Probe.",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    try:
        text = tokenizer.apply_chat_template(
            user_turn("Hi"), tools=[probe], add_generation_prompt=True, tokenize=False
        )
    except Exception:  # a template may refuse tools its own way (jinja errors, TypeError)
        return False
    return isinstance(text, str) and PROBE_TOOL_NAME in text


def template_renders_tool_calls(tokenizer) -> bool:
    """Whether ``tokenizer``'s chat template shows an assistant turn's ``tool_calls`` (a
    conversation holding a probe call renders the call's name)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    call = {"type": "function", "function": {"name": PROBE_TOOL_NAME, "arguments": {}}}
    turns = [*user_turn("Hi"), {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False)
    except Exception:  # a template may refuse such turns its own way
        return False
    return isinstance(text, str) and PROBE_TOOL_NAME in text


def prompt_token_ids(
    tokenizer,
    prompt: str | Sequence[Mapping[str, str]],
    *,
    use_chat_template: bool,
    tools: Sequence[Mapping] | None = None,
) -> list[int]:
    """Token ids of ``prompt`` for ``tokenizer`` (a Hugging Face tokenizer; callers that accept
    ids without one check for it first, each with its own error).

    - chat turns (``[{"role": "user", "content": "Hi"}, ...]``): rendered with the tokenizer's
      chat template, the assistant's generation prompt appended. A tokenizer without a chat
      template is an error: turns have no plain-text form.
    - text with ``use_chat_template`` and a tokenizer that has a chat template: the text as one
      user turn (:func:`user_turn`), rendered as above. Without a template, as below.
    - text otherwise: the tokenizer's own encoding with its special tokens (a completion).

    ``use_chat_template`` concerns text only; chat turns always go through the template.
    ``tools`` (OpenAI tool objects) go to the template with the turns (check
    :func:`template_renders_tools` first: many templates ignore them).
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, str):
        if not (use_chat_template and has_template):
            return _encode_text(tokenizer, prompt)
        prompt = user_turn(prompt)
    elif not has_template:
        raise InvalidRequestError(
            "this model has no chat template: use completions instead", param="messages"
        )
    extra = {"tools": [dict(tool) for tool in tools]} if tools else {}
    encoded = tokenizer.apply_chat_template(
        list(prompt), add_generation_prompt=True, tokenize=True, **extra
    )
    if hasattr(encoded, "keys"):  # a BatchEncoding (transformers 5), else a list of ids
        encoded = encoded["input_ids"]
    return list(encoded)


def _encode_text(tokenizer, text: str) -> list[int]:
    """``tokenizer(text, add_special_tokens=True)["input_ids"]``. A fast tokenizer whose
    backend is in the state that call would put it in (no truncation, no padding, special
    tokens split as the tokenizer says) is asked directly: the same ids without the wrapper's
    per-call work (~25 us of a served request's CPU on its front end)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is not None
        and backend.truncation is None
        and backend.padding is None
        and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False))
    ):
        return backend.encode(text, add_special_tokens=True).ids
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])
