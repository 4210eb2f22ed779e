"""Text around token ids: prompts in (plain, chat template), streamed text out (incremental
detokenization that never splits a character, stop strings that never leak a prefix)."""

from __future__ import annotations

from collections.abc import Sequence

from specray.errors import InvalidRequestError

REPLACEMENT_CHAR = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to


def encode_prompt(tokenizer, prompt: str | None, messages: Sequence[dict] | None) -> list[int]:
    """Token ids of a text prompt or of chat turns rendered with the model's chat template."""
    if tokenizer is None:
        raise InvalidRequestError(
            "this model has no tokenizer: send prompt token ids instead of text", param="prompt"
        )
    if messages is not None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise InvalidRequestError(
                "this model has no chat template: use completions instead", param="messages"
            )
        encoded = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True
        )
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


class TextStream:
    """Decodes a growing list of token ids into text deltas and applies stop strings.

    ``push(token_ids)`` returns the text that is safe to emit: it holds back a trailing
    incomplete character, and the last ``len(longest stop) - 1`` characters, which could be
    the start of a stop string. ``stopped`` is set when a stop string appeared; the text then
    ends right before it. ``flush()`` returns what was held back once the output is final.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far (stop applied)
        self.emitted = 0  # characters of ``text`` already returned
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped or self.tokenizer is None:
            self.token_ids.extend(token_ids)
            return ""
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = self._first_stop(text)
        if cut is not None:
            self.text, self.stopped = text[:cut], True
            return self._take(len(self.text))
        self.text = text
        safe = len(text) - self._hold
        while safe > self.emitted and text[safe - 1] == REPLACEMENT_CHAR:
            safe -= 1
        return self._take(safe)

    def flush(self) -> str:
        return self._take(len(self.text))

    def _first_stop(self, text: str) -> int | None:
        # Search from just before the new text: a stop string may straddle two deltas.
        start = max(self.emitted - self._hold, 0)
        found = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _take(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        piece, self.emitted = self.text[self.emitted : end], end
        return piece
