"""Streamed text out of token ids: incremental detokenization that never splits a character,
stop strings that never leak a prefix. (Prompts in: :mod:`specray.prompts`.)"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT_CHAR = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to


class TextStream:
    """Decodes a growing list of token ids into text deltas and applies stop strings.

    ``push(token_ids)`` returns the text that is safe to emit: it holds back a trailing
    incomplete character, and the last ``len(longest stop) - 1`` characters, which could be
    the start of a stop string. ``stopped`` is set when a stop string appeared; the text then
    ends right before it (right after it with ``include_stop``); none counts before
    ``min_tokens`` tokens. ``flush()`` returns what was held back once the output is final.
    ``kept_tokens``: the tokens the output keeps, all of them, or once a stop string appeared
    those through the token that completed it (as vLLM counts: what comes after it is not
    delivered, however many tokens a speculative round committed past it).

    Decoding is incremental: each push decodes only the tokens since the last complete
    character, with the chunk before them as context (a token's text can depend on its left
    neighbour), so a long output costs O(length), not O(length^2), per request. With
    ``deferred`` (no stop strings, and a caller that takes the text only once the output is
    final) nothing is decoded before ``flush()``, which decodes the whole output once.
    """

    def __init__(
        self,
        tokenizer,
        stop: Sequence[str] = (),
        *,
        include_stop: bool = False,
        min_tokens: int = 0,
        deferred: bool = False,
    ):
        if deferred and stop:
            raise ValueError("a deferred TextStream cannot match stop strings: they end it early")
        self.tokenizer = tokenizer
        self.deferred = deferred
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.min_tokens = min_tokens  # stop strings count from this many tokens on (vLLM's)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far (stop applied)
        self.emitted = 0  # characters of ``text`` already returned
        self.stopped = False
        self._prefix = 0  # the decode window starts here (context for the new tokens)
        self._read = 0  # tokens whose text is in ``text``
        # (tokens read, len(text)) after each decode that added text: where a character of
        # ``text`` came from, to the decode (a few tokens) that added it
        self._marks: list[tuple[int, int]] = [(0, 0)]
        self.kept_tokens = 0

    def push(self, token_ids: Sequence[int]) -> str:
        self.token_ids.extend(token_ids)
        if self.stopped:
            return ""
        self.kept_tokens = len(self.token_ids)
        if self.tokenizer is None or self.deferred:
            return ""
        self._decode_new(force=False)
        found = self._first_stop(self.text) if len(self.token_ids) >= self.min_tokens else None
        if found is not None:
            cut, stop = found
            self.kept_tokens = max(self._tokens_through(cut + len(stop)), self.min_tokens)
            self.text, self.stopped = self.text[: cut + len(stop) * self.include_stop], True
            return self._take(len(self.text))
        return self._take(len(self.text) - self._hold)

    def flush(self) -> str:
        if not self.stopped and self.tokenizer is not None:
            self._decode_new(force=True)  # the output is final: an incomplete tail included
        return self._take(len(self.text))

    def _decode_new(self, *, force: bool) -> None:
        """Append the text of the tokens not yet read, unless it ends mid-character."""
        decode = self.tokenizer.decode
        window = self.token_ids[self._prefix :]
        context = window[: self._read - self._prefix]
        before = decode(context, skip_special_tokens=True) if context else ""
        after = decode(window, skip_special_tokens=True)
        if len(after) <= len(before) or (after.endswith(REPLACEMENT_CHAR) and not force):
            return
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self.token_ids)
        self._marks.append((self._read, len(self.text)))

    def _tokens_through(self, end: int) -> int:
        """The fewest tokens whose text reaches character ``end`` of ``text``.

        Example: tokens "He", "llo", " wor", "ld" decoded in two pushes (marks at 2 tokens / 5
        characters and 4 / 11): ``end`` 8 lies in the second push's text, where "Hello wor"
        reaches 9 characters with 3 tokens, so 3.
        """
        marks = self._marks
        after = next(i for i, (_, length) in enumerate(marks) if length >= end)
        (start, start_chars), (stop, _) = marks[after - 1], marks[after]
        context = marks[after - 2][0] if after >= 2 else 0  # the decode window's start
        decode = self.tokenizer.decode
        base = len(decode(self.token_ids[context:start], skip_special_tokens=True))
        for count in range(start + 1, stop):
            text = decode(self.token_ids[context:count], skip_special_tokens=True)
            if start_chars + len(text) - base >= end and not text.endswith(REPLACEMENT_CHAR):
                return count
        return stop

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """Where the first stop string starts, and which (the longest of those starting
        there)."""
        # Search from just before the new text: a stop string may straddle two deltas.
        start = max(self.emitted - self._hold, 0)
        found = [(i, s) for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(found, key=lambda hit: (hit[0], -len(hit[1]))) if found else None

    def _take(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        piece, self.emitted = self.text[self.emitted : end], end
        return piece
