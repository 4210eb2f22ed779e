"""Checks of one OpenAI request field each: the value in, the checked value out, or an
:class:`InvalidRequestError` naming the field and showing the value. Shared by the request
parsers (:mod:`specray.serve.openai_schema`, :mod:`specray.serve.openai_structured`)."""

from __future__ import annotations

from typing import Any

from specray.errors import InvalidRequestError

MAX_SHOWN_CHARS = 80  # of a rejected value, quoted in an error message


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."


def invalid(param: str | None, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(name, f"{name} must be a number, got {show(value)}")
    try:
        # A float from here on: an int past float's range must not overflow further in.
        return float(value)
    except OverflowError:
        raise invalid(name, f"{name} must be a finite number, got a huge integer") from None


def integer(name: str, value: Any) -> int:
    if not is_int(value):
        raise invalid(name, f"{name} must be an integer, got {show(value)}")
    return value


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise invalid(name, f"{name} must be true or false, got {show(value)}")
    return value


def token_ids(name: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not all(is_int(v) for v in value):
        raise invalid(name, f"{name} must be a list of integer token ids, got {show(value)}")
    return value


def logit_bias(name: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise invalid(name, f"{name} must be an object of token id -> bias, got {show(value)}")
    return value


def string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise invalid(name, f"{name} must be a string, got {show(value)}")
    return value


def non_empty_string(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(name, f"{name} must be a non-empty string, got {show(value)}")
    return value


def obj(name: str, value: Any) -> dict:
    """A JSON object."""
    if not isinstance(value, dict):
        raise invalid(name, f"{name} must be an object, got {show(value)}")
    return value


def top_k(name: str, value: Any) -> int:
    # vLLM spells "off" -1; SamplingParams spells it 0.
    return 0 if integer(name, value) == -1 else value
