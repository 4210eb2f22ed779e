"""Tool calls out of a chat choice's generated text: the message's ``tool_calls`` and their
stream deltas (the request side is :mod:`specray.serve.openai_structured`). Small incremental
parsers, no web framework and no torch.

- named (``tool_choice`` names a function): the output, constrained by the function's
  parameters schema, is its arguments: one call whose ``arguments`` is the text as generated.
- required: the output is the grammar's array ``[{"name": ..., "parameters": {...}}, ...]``;
  each element is a call whose ``arguments`` is its ``parameters`` value's text as generated.
- auto (where the chat template renders tools): the model decides; a call is a
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block (the Hermes format the
  Qwen2.5, Qwen3, SmolLM3 and Hermes templates ask for) and the text around the blocks is the
  content. A block that is not such JSON stays in the content.

A parser reads the text as it is generated, so a stream's deltas concatenated are the
non-streamed message. A call is announced (``id``, ``type``, ``function.name``) once its name
is known; its arguments follow as they grow. The choice's ``finish_reason`` is "tool_calls"
when the output ended ("stop") with its calls whole; a cut output ("length") keeps its reason,
and the last call's arguments may then be incomplete JSON.

Example (required): the text ``[{"name":"f","parameters":{"a":1}}]`` in three pieces
``[{"name":"f"``, ``,"parameters":{"a"`` and ``:1}}]`` gives the deltas
``[{"index": 0, "id": "call_...", "type": "function", "function": {"name": "f",
"arguments": ""}}]``, ``[{"index": 0, "function": {"arguments": "{\\"a\\""}}]`` and
``[{"index": 0, "function": {"arguments": ":1}"}}]``.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from specray.serve.openai_structured import ToolCalling

TOOL_CALL_ID_HEX = 24  # "call_" and this many hex digits (OpenAI's ids are 24 characters)
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"  # the Hermes format (auto)
JSON_BLANKS = " \t\n\r"  # JSON's whitespace


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:TOOL_CALL_ID_HEX]}"


class ToolCallParser(ABC):
    """One choice's text in, as generated; content and tool-call deltas out.

    Subclasses grow ``calls`` (OpenAI's ``{"id", "type", "function": {"name", "arguments"}}``)
    and ``content`` from the text; the deltas are what changed since the last push."""

    def __init__(self):
        self.calls: list[dict] = []
        self.content = ""
        self._sent: list[int] = []  # per call: characters of its arguments already sent

    def push(self, text: str) -> tuple[str, list[dict]]:
        """``text`` appended to the output -> (new content, tool-call deltas)."""
        content = self._read(text)
        self.content += content
        return content, self._deltas()

    def flush(self) -> tuple[str, list[dict]]:
        """The output is final: what was held back."""
        content = self._end()
        self.content += content
        return content, self._deltas()

    @property
    @abstractmethod
    def complete(self) -> bool:
        """Whether the output holds its calls whole (its grammar, or its last block, ended)."""

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if reason == "stop" and self.calls and self.complete else reason

    def message(self) -> dict:
        """The non-streamed choice's message (after :meth:`flush`)."""
        content = self.content if self.content.strip() or not self.calls else ""
        message = {"role": "assistant", "content": content or None}
        if self.calls:
            message["tool_calls"] = self.calls
        return message

    @abstractmethod
    def _read(self, text: str) -> str:
        """Take ``text`` (appended to the output): grow ``calls``; return the new content."""

    def _end(self) -> str:
        return ""

    def _add_call(self, name: str, arguments: str = "") -> dict:
        call = {"id": tool_call_id(), "type": "function"}
        call["function"] = {"name": name, "arguments": arguments}
        self.calls.append(call)
        return call

    def _deltas(self) -> list[dict]:
        deltas = []
        for index, call in enumerate(self.calls):
            arguments = call["function"]["arguments"]
            if index == len(self._sent):  # new: announced with the arguments so far
                function = {"name": call["function"]["name"], "arguments": arguments}
                deltas.append({"index": index, "id": call["id"], "type": "function"})
                deltas[-1]["function"] = function
                self._sent.append(len(arguments))
            elif len(arguments) > self._sent[index]:
                piece = arguments[self._sent[index] :]
                deltas.append({"index": index, "function": {"arguments": piece}})
                self._sent[index] = len(arguments)
        return deltas


class NamedCall(ToolCallParser):
    """``tool_choice`` names a function: the whole output is its arguments."""

    def __init__(self, name: str):
        super().__init__()
        self._add_call(name)

    def _read(self, text: str) -> str:
        self.calls[0]["function"]["arguments"] += text
        return ""

    @property
    def complete(self) -> bool:
        try:
            json.loads(self.calls[0]["function"]["arguments"])
        except ValueError:
            return False
        return True


class RequiredCalls(ToolCallParser):
    """``tool_choice: "required"``: the output is ``[{"name": ..., "parameters": ...}, ...]``,
    scanned character by character as it grows (the grammar's key order)."""

    def __init__(self):
        super().__init__()
        self._text = ""
        self._depth = 0  # brackets and braces open outside strings
        self._in_string = self._escaped = False
        self._expect = "key"  # in an element (depth 2): "key", "colon" or "value"
        self._key_start = 0
        self._key = ""
        self._elements: list[dict[str, list]] = []  # per element: key -> [start, end | None]
        self._closed = False  # the array ended

    def _read(self, text: str) -> str:
        start = len(self._text)
        self._text += text
        for position in range(start, len(self._text)):
            self._scan(position, self._text[position])
        if self._elements:
            self._update(len(self._elements) - 1)
        return ""

    def _scan(self, position: int, char: str) -> None:
        element = self._elements[-1] if self._elements else None
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                if self._depth == 2 and self._expect == "key":
                    self._key = json.loads(self._text[self._key_start : position + 1])
                    self._expect = "colon"
        elif char == '"':
            self._in_string = True
            self._key_start = position
        elif char in "[{":
            self._depth += 1
            if self._depth == 2:  # an element starts
                self._elements.append({})
                self._expect = "key"
        elif char in "]}":
            if self._depth == 2 and element is not None and self._expect == "value":
                element[self._key][1] = position  # the element ends, and its last value
                self._update(len(self._elements) - 1)
            self._depth -= 1
            self._closed = self._depth == 0
        elif self._depth == 2 and element is not None:
            if char == ":" and self._expect == "colon":
                element[self._key] = [position + 1, None]
                self._expect = "value"
            elif char == "," and self._expect == "value":
                element[self._key][1] = position
                self._expect = "key"
                self._update(len(self._elements) - 1)

    def _update(self, index: int) -> None:
        """Element ``index``'s call: announced once its name is whole, arguments as far as
        its parameters' text goes."""
        element = self._elements[index]
        if index > len(self.calls):  # an earlier element has no name: not a call list
            return
        if index == len(self.calls):
            start, end = element.get("name", (0, None))
            if end is None:
                return
            name = json.loads(self._text[start:end])
            self._add_call(name if isinstance(name, str) else json.dumps(name))
        if "parameters" in element:
            start, end = element["parameters"]
            arguments = self._text[start : len(self._text) if end is None else end]
            # (the blank after the colon is the separator's, not the value's)
            self.calls[index]["function"]["arguments"] = arguments.lstrip(JSON_BLANKS)

    @property
    def complete(self) -> bool:
        return self._closed and all(
            element.get("parameters", (0, None))[1] is not None for element in self._elements
        )


class TaggedCalls(ToolCallParser):
    """``tool_choice: "auto"``: ``<tool_call>{...}</tool_call>`` blocks among content. A block
    is read whole (its JSON is parsed at the closing tag); text that may be the start of an
    opening tag is held back."""

    def __init__(self):
        super().__init__()
        self._buffer = ""  # not yet content: a possible tag start, or an open block
        self._open = False  # inside a block
        self._cut = False  # the output ended inside a block

    def _read(self, text: str) -> str:
        self._buffer += text
        content = ""
        while True:
            tag = TOOL_CALL_CLOSE if self._open else TOOL_CALL_OPEN
            found = self._buffer.find(tag)
            if found < 0:
                break
            before, self._buffer = self._buffer[:found], self._buffer[found + len(tag) :]
            if self._open:
                content += self._block(before)
            else:
                content += before
            self._open = not self._open
        if not self._open:  # keep back what may begin an opening tag
            keep = next(
                (n for n in range(len(TOOL_CALL_OPEN) - 1, 0, -1)
                 if self._buffer.endswith(TOOL_CALL_OPEN[:n])),
                0,
            )  # fmt: skip
            cut = len(self._buffer) - keep
            content, self._buffer = content + self._buffer[:cut], self._buffer[cut:]
        return content

    def _block(self, text: str) -> str:
        """A closed block: a call, or (not a call's JSON) content as it was."""
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if (
            not isinstance(value, dict)
            or not isinstance(value.get("name"), str)
            or not isinstance(value.get("arguments", {}), dict | str)
        ):
            return TOOL_CALL_OPEN + text + TOOL_CALL_CLOSE
        arguments = value.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        self._add_call(value["name"], arguments)
        return ""

    def _end(self) -> str:
        rest = (TOOL_CALL_OPEN if self._open else "") + self._buffer
        self._cut, self._buffer, self._open = self._open, "", False
        return rest

    @property
    def complete(self) -> bool:
        return not self._open and not self._cut


def tool_calls_as_text(messages: Sequence[Mapping]) -> list[dict]:
    """Chat turns for a template that ignores ``tool_calls``: each assistant turn's calls
    appended to its content as the Hermes blocks ``auto`` parses, so the model is shown what
    it called before the ``tool`` turns that answer it."""
    turns = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            turns.append(dict(message))
            continue
        blocks = "".join(
            TOOL_CALL_OPEN
            + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
            + TOOL_CALL_CLOSE
            for c in calls
        )
        rest = {key: value for key, value in message.items() if key != "tool_calls"}
        turns.append(rest | {"content": (message.get("content") or "") + blocks})
    return turns


def tool_call_parser(tools: ToolCalling | None) -> ToolCallParser | None:
    """A new parser for one choice of a call with ``tools`` (None: the text is the content)."""
    if tools is None or tools.mode == "none":
        return None
    if tools.mode == "named":
        return NamedCall(tools.name)
    if tools.mode == "required":
        return RequiredCalls()
    return TaggedCalls()
