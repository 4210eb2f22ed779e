"""Log-probabilities in the response shapes of OpenAI's and vLLM's HTTP APIs: pure functions
of the generation events' entries (:mod:`specray.serve.protocol`: ``{"token_id", "token",
"logprob", "rank", "top"}``, token texts already decoded), no tokenizer and no torch.

- :func:`completion_logprobs`: OpenAI's legacy ``choices[i].logprobs`` of ``/v1/completions``,
  parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs`` (per position the chosen
  token and the n most likely, by text) and ``text_offset``;
- :func:`chat_logprobs`: ``choices[i].logprobs`` of ``/v1/chat/completions``, ``{"content":
  [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``;
- :func:`prompt_logprobs`: vLLM's ``prompt_logprobs``, ``[None, {token id: {"logprob",
  "rank", "decoded_token"}}, ...]``.

JSON has no -inf (a token the processed distribution excludes): it is sent as
:data:`JSON_MIN_LOGPROB`, as vLLM does. An entry whose ``logprob`` is None (the first prompt
token: nothing precedes it) is a null position.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

JSON_MIN_LOGPROB = -9999.0  # what -inf is sent as (vLLM's choice; JSON cannot spell -inf)


def _finite(logprob: float) -> float:
    return max(logprob, JSON_MIN_LOGPROB)


def completion_logprobs(entries: Sequence[Mapping], num_top: int, *, text_offset: int = 0) -> dict:
    """OpenAI's legacy completions logprobs over ``entries`` (with ``echo``, the prompt's
    first). ``text_offset``: the first token's (a stream chunk's: the lengths of the token
    texts sent before it); each next token's is after the text of the one before, each
    token's text decoded on its own (as vLLM counts).

    Example: entries "The" (-0.5, most likely "The" -0.5, "A" -1.2) and " cat" (-2.0, most
    likely " dog" -1.0) with ``num_top`` 1 give tokens ["The", " cat"], token_logprobs
    [-0.5, -2.0], top_logprobs [{"The": -0.5}, {" cat": -2.0, " dog": -1.0}], text_offset
    [0, 3].
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        tokens.append(entry["token"])
        offsets.append(text_offset)
        text_offset += len(entry["token"])
        if entry["logprob"] is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_finite(entry["logprob"]))
        top = {entry["token"]: _finite(entry["logprob"])}  # the chosen token, then the likely
        for alternative in entry["top"][:num_top]:
            top.setdefault(alternative["token"], _finite(alternative["logprob"]))
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _chat_token(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: Sequence[Mapping], num_top: int) -> dict:
    """Chat completions logprobs: per token its text, log-probability and UTF-8 bytes, and
    ``top_logprobs`` the ``num_top`` most likely tokens (OpenAI's ``top_logprobs``)."""
    return {
        "content": [
            _chat_token(entry["token"], entry["logprob"])
            | {
                "top_logprobs": [
                    _chat_token(top["token"], top["logprob"]) for top in entry["top"][:num_top]
                ]
            }
            for entry in entries
        ]
    }


def prompt_logprobs(entries: Sequence[Mapping], num_top: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per position the
    prompt token (its rank) and the ``num_top`` most likely (ranks 1 ..), keyed by token id
    (a JSON object's keys are strings); the prompt token among the most likely appears once."""
    positions: list[dict | None] = []
    for entry in entries:
        if entry["logprob"] is None:
            positions.append(None)
            continue
        position = {
            str(entry["token_id"]): {
                "logprob": _finite(entry["logprob"]),
                "rank": entry["rank"],
                "decoded_token": entry["token"],
            }
        }
        for rank, top in enumerate(entry["top"][:num_top], start=1):
            position[str(top["token_id"])] = {
                "logprob": _finite(top["logprob"]),
                "rank": rank,
                "decoded_token": top["token"],
            }
        positions.append(position)
    return positions
