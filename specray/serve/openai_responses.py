"""Backend events out (:mod:`specray.serve.protocol`), OpenAI response objects and stream
chunks in: plain dicts, no web framework and no torch. The request side, and the decisions it
documents, is :mod:`specray.serve.openai_schema`; log-probability shapes are
:mod:`specray.serve.openai_logprobs`.

Log-probabilities, ``echo`` and vLLM's ``prompt_logprobs``:

- ``choices[i].logprobs``: completions' legacy lists, chat's ``{"content": [...]}``; a stream
  chunk carries those of the tokens it delivers (a chunk may carry tokens whose text still
  lags, with ``""``), so the chunks' lists concatenated are the non-streamed response's.
- ``echo`` (completions): the prompt text leads the choice's text (the first chunk's when
  streaming) and, with ``logprobs``, the prompt's tokens lead the lists, the first with null
  ``token_logprobs`` and ``top_logprobs`` (nothing precedes it).
- ``text_offset`` counts the texts of the tokens before (each decoded on its own, as vLLM
  counts), from 0 at the choice's first token, streamed or not.
- ``prompt_logprobs`` (vLLM's, not streamed): per choice on completions, once at the top level
  on chat (every choice has the same prompt), as vLLM places them.

Tool calls (chat with ``tools``): each choice's text goes through a parser of
:mod:`specray.serve.openai_tools`, which makes the message's ``tool_calls`` (``content`` null
when the output is the calls) and, streamed, the chunks' ``delta.tool_calls``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from specray.errors import SpecrayError
from specray.serve.openai_logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from specray.serve.openai_schema import ApiCall
from specray.serve.openai_tools import ToolCallParser, tool_call_parser


def merge_speculative(blocks: Sequence[Mapping]) -> dict:
    """Several requests' speculative-decoding blocks as one (counts summed, rates recomputed).

    Example: blocks with 2 drafts / 8 draft tokens / 6 accepted, per position [2, 2, 1, 1],
    and 1 / 4 / 1, [1] merge to 3 / 12 / 7, [3, 2, 1, 1], acceptance_rate 7/12 and
    mean_acceptance_length 1 + 7/3."""
    drafts = sum(b["num_drafts"] for b in blocks)
    draft_tokens = sum(b["num_draft_tokens"] for b in blocks)
    accepted = sum(b["num_accepted_tokens"] for b in blocks)
    size = max((len(b["num_accepted_tokens_per_pos"]) for b in blocks), default=0)
    per_pos = [0] * size
    for block in blocks:
        for position, count in enumerate(block["num_accepted_tokens_per_pos"]):
            per_pos[position] += count
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": per_pos,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
    }


def usage(call: ApiCall, finals: Sequence[Mapping]) -> dict:
    prompt_tokens = sum(final["prompt_tokens"] for final in finals[:: call.n])
    completion_tokens = sum(final["completion_tokens"] for final in finals)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(call: ApiCall, object_name: str) -> dict:
    return {
        "id": call.id,
        "object": object_name,
        "created": call.created,
        "model": call.model,
        "system_fingerprint": None,
    }


def _logprobs(call: ApiCall, entries: Sequence[Mapping] | None, text_offset: int) -> dict | None:
    """A choice's (or chunk's) ``logprobs`` over ``entries``; None unless asked."""
    if call.logprobs is None or entries is None:
        return None
    if call.chat:
        return chat_logprobs(entries, call.logprobs)
    return completion_logprobs(entries, call.logprobs, text_offset=text_offset)


def _echoed(echo: str | None, text: str, entries: list | None, event: Mapping):
    """``text`` and ``entries`` led by the prompt's (``echo``: its text; None: no echo)."""
    if echo is None:
        return text, entries
    if entries is not None:
        entries = [*event["prompt_logprobs"], *entries]
    return echo + text, entries


def response(call: ApiCall, finals: Sequence[Mapping], echoes: Sequence[str] | None = None) -> dict:
    """The non-streamed response, from each choice's final event (in index order); with
    ``echo``, ``echoes`` holds each choice's prompt text."""
    choices = []
    for index, final in enumerate(finals):
        echo = echoes[index] if echoes is not None else None
        text, entries = _echoed(echo, final["text"], final.get("logprobs"), final)
        finish_reason = final["finish_reason"]
        parser = tool_call_parser(call.tools)
        if parser is not None:
            parser.push(text)
            parser.flush()
            output = {"message": parser.message()}
            finish_reason = parser.finish_reason(finish_reason)
        elif call.chat:
            output = {"message": {"role": "assistant", "content": text}}
        else:
            output = {"text": text}
        choice = (
            {"index": index}
            | output
            | {
                "logprobs": _logprobs(call, entries, 0),
                "finish_reason": finish_reason,
                "speculative_decoding": final["speculative_decoding"],
            }
        )
        if call.prompt_logprobs is not None and not call.chat:
            choice["prompt_logprobs"] = prompt_logprobs(
                final["prompt_logprobs"], call.prompt_logprobs
            )
        choices.append(choice)
    out = _envelope(call, call.object) | {
        "choices": choices,
        "usage": usage(call, finals),
        "speculative_decoding": merge_speculative([f["speculative_decoding"] for f in finals]),
    }
    if call.prompt_logprobs is not None and call.chat:
        out["prompt_logprobs"] = prompt_logprobs(finals[0]["prompt_logprobs"], call.prompt_logprobs)
    return out


def chunk(
    call: ApiCall,
    index: int,
    text: str | None,
    *,
    logprobs: dict | None = None,
    final: Mapping | None = None,
    tool_calls: list[dict] | None = None,
    finish_reason: str | None = None,
) -> dict:
    """One stream chunk for choice ``index``: ``text`` (chat: None = the role opener), its
    ``tool_calls`` deltas and the ``logprobs`` of its tokens, and when ``final`` is given, that
    choice's finish reason (``finish_reason``, else the final's) and speculative metrics."""
    if call.chat:
        # named and required tool choices: the output is the calls, and content stays null
        calls_only = call.tools is not None and call.tools.constraint is not None
        if text is None:
            delta = {"role": "assistant", "content": None if calls_only else ""}
        elif text or not (final is not None or tool_calls or calls_only):
            delta = {"content": text}  # (empty: a chunk that carries logprobs only)
        else:
            delta = {}
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta}
    else:
        choice = {"index": index, "text": text or ""}
    if final is not None:
        finish_reason = finish_reason or final["finish_reason"]
    choice |= {"logprobs": logprobs, "finish_reason": finish_reason}
    if final is not None:
        choice["speculative_decoding"] = final["speculative_decoding"]
    out = _envelope(call, f"{call.object}.chunk" if call.chat else call.object)
    out["choices"] = [choice]
    if call.include_usage:
        out["usage"] = None  # as OpenAI: only the last chunk carries usage
    return out


class StreamedChoice:
    """What one choice's stream has sent: the chunk each of its events becomes.

    A delta's chunk carries its text and its tokens' logprobs; the final's, whatever the deltas
    have not sent (normally nothing) and the finish reason. With ``echo`` (the prompt's text)
    the choice's first chunk leads with the prompt."""

    def __init__(self, call: ApiCall, index: int, echo: str | None = None):
        self.call, self.index = call, index
        self._echo = echo  # None once sent (or without echo)
        self._tools: ToolCallParser | None = tool_call_parser(call.tools)
        self.sent_chars = 0  # of the generated text
        self.sent_tokens = 0
        self.text_offset = 0  # the next token's: the lengths of the token texts sent

    def chunk(self, event: Mapping) -> dict | None:
        """The chunk for ``event`` (None: a delta with nothing to send)."""
        final = event if event["kind"] == "final" else None
        text, entries = event["text"], event.get("logprobs")
        if final is None:
            self.sent_tokens += len(event["token_ids"])
        else:  # the final text and logprobs are the whole output's: send what is left
            text = text[self.sent_chars :]
            entries = None if entries is None else entries[self.sent_tokens :]
        self.sent_chars += len(text)
        text, entries = _echoed(self._echo, text, entries, event)
        self._echo = None
        tool_calls, finish_reason = [], None
        if self._tools is not None:
            text, tool_calls = self._tools.push(text)
            if final is not None:
                rest, more = self._tools.flush()
                text, tool_calls = text + rest, tool_calls + more
                finish_reason = self._tools.finish_reason(final["finish_reason"])
        if final is None and not text and not entries and not tool_calls:
            return None
        logprobs = _logprobs(self.call, entries, self.text_offset) if entries else None
        self.text_offset += sum(len(entry["token"]) for entry in entries or ())
        return chunk(
            self.call,
            self.index,
            text,
            logprobs=logprobs,
            final=final,
            tool_calls=tool_calls,
            finish_reason=finish_reason,
        )


def usage_chunk(call: ApiCall, finals: Sequence[Mapping]) -> dict:
    """The last chunk with ``include_usage``: no choices; usage and the merged metrics."""
    out = _envelope(call, f"{call.object}.chunk" if call.chat else call.object)
    return out | {
        "choices": [],
        "usage": usage(call, finals),
        "speculative_decoding": merge_speculative([f["speculative_decoding"] for f in finals]),
    }


def error_body(error: SpecrayError) -> dict:
    """OpenAI's error shape."""
    return {
        "error": {
            "message": error.message,
            "type": error.error_type,
            "param": error.param,
            "code": getattr(error, "code", None),
        }
    }
