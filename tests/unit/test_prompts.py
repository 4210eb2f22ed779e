"""specray.prompts: the one prompt encoding. On the bundled tokenizer it gives the ids the
engine and the served API gave before they shared it (each former recipe written out here as
the oracle); without a chat template, text falls back to plain and chat turns are an error."""

from __future__ import annotations

import pytest

from specray.errors import InvalidRequestError
from specray.models.loading import load_tokenizer, resolve_model_dir
from specray.prompts import prompt_token_ids, user_turn

TEXTS = [
    "Hello world",
    "  leading spaces, émoji 🙂 and\nnewlines\t",
    "def f(x):\n    return x",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
]
TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 + 3?"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_dir("default"))


def _rendered(tokenizer, turns) -> list[int]:
    encoded = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.mark.parametrize("text", TEXTS)
def test_plain_text_is_the_tokenizers_encoding_with_special_tokens(tokenizer, text):
    ids = prompt_token_ids(tokenizer, text, use_chat_template=False)
    assert ids == list(tokenizer.encode(text))  # the engine's former recipe
    assert ids == list(tokenizer(text, add_special_tokens=True)["input_ids"])  # the server's


def test_a_backend_left_truncating_is_not_asked_directly(tokenizer):
    text = TEXTS[1]
    full = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    tokenizer.backend_tokenizer.enable_truncation(max_length=3)  # as a caller may leave it
    try:
        assert prompt_token_ids(tokenizer, text, use_chat_template=False) == full
    finally:
        tokenizer.backend_tokenizer.no_truncation()
    assert len(full) > 3


@pytest.mark.parametrize("text", TEXTS)
def test_text_with_the_chat_template_is_one_user_turn(tokenizer, text):
    ids = prompt_token_ids(tokenizer, text, use_chat_template=True)
    assert ids == _rendered(tokenizer, [{"role": "user", "content": text}])
    assert ids != prompt_token_ids(tokenizer, text, use_chat_template=False)


def test_chat_turns_are_rendered_whatever_use_chat_template_says(tokenizer):
    expected = _rendered(tokenizer, TURNS)
    assert prompt_token_ids(tokenizer, TURNS, use_chat_template=True) == expected
    assert prompt_token_ids(tokenizer, tuple(TURNS), use_chat_template=False) == expected
    assert prompt_token_ids(tokenizer, user_turn("Hi"), use_chat_template=True) == (
        prompt_token_ids(tokenizer, "Hi", use_chat_template=True)
    )


class _NoTemplate:
    """A tokenizer without a chat template: one id per character."""

    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool):
        return {"input_ids": [0, *map(ord, text)] if add_special_tokens else list(map(ord, text))}


def test_without_a_chat_template_text_is_plain_and_turns_are_an_error():
    assert prompt_token_ids(_NoTemplate(), "ab", use_chat_template=True) == [0, 97, 98]
    with pytest.raises(InvalidRequestError, match="no chat template") as error:
        prompt_token_ids(_NoTemplate(), user_turn("ab"), use_chat_template=True)
    assert error.value.param == "messages"
