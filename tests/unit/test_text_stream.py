"""Stop strings in streamed text (specray.serve.text.TextStream) on the bundled tokenizer: the
text ends before the stop string, and the output keeps the tokens through the one that
completed it (as vLLM counts; a speculative round may have committed more), whatever pushes
the tokens came in."""

from __future__ import annotations

import pytest

from specray.models.loading import load_tokenizer, resolve_model_dir
from specray.serve.text import TextStream

TEXT = "Hello world, the quick brown fox jumps over the lazy dog."
# 'Hello' ' world' ',' ' the' ' quick' ' brown' ' fox' ' jumps' ' over' ' the' ' lazy' ' dog' '.'
NUM_TOKENS = 13
PUSHES = [(NUM_TOKENS,), (1,) * NUM_TOKENS, (2, 5, 6), (6, 7)]  # tokens per push


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_dir("default"))


@pytest.fixture(scope="module")
def token_ids(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) == NUM_TOKENS
    return ids


def _push_all(stream: TextStream, token_ids, sizes) -> str:
    emitted, start = "", 0
    for size in sizes:
        emitted += stream.push(token_ids[start : start + size])
        start += size
    return emitted + stream.flush()


@pytest.mark.parametrize("sizes", PUSHES)
@pytest.mark.parametrize(
    ("stop", "kept"),
    [
        ("quick", 5),  # ends with ' quick', the 5th token
        ("ck bro", 6),  # ends inside ' brown'
        ("ld,", 3),  # spans ' world' and ','
        (" the", 4),  # the first of two
    ],
)
def test_a_stop_string_keeps_the_tokens_through_the_one_completing_it(
    tokenizer, token_ids, sizes, stop, kept
):
    for include_stop in (False, True):
        stream = TextStream(tokenizer, [stop], include_stop=include_stop)
        emitted = _push_all(stream, token_ids, sizes)
        end = TEXT.find(stop) + len(stop) * include_stop
        assert stream.stopped and emitted == stream.text == TEXT[:end]
        assert stream.kept_tokens == kept


def test_without_a_stop_every_token_is_kept_and_min_tokens_holds_stops_off(tokenizer, token_ids):
    stream = TextStream(tokenizer, ["zebra"])
    assert _push_all(stream, token_ids, (2, 5, 6)) == TEXT and stream.kept_tokens == NUM_TOKENS
    # "world" is complete after 2 tokens, but stop strings count from 4 tokens on
    stream = TextStream(tokenizer, ["world"], min_tokens=4)
    _push_all(stream, token_ids, (1,) * NUM_TOKENS)
    assert stream.stopped and stream.text == "Hello " and stream.kept_tokens == 4


@pytest.mark.parametrize("sizes", PUSHES)
def test_a_deferred_stream_decodes_once_at_the_end_to_the_streamed_text(
    tokenizer, token_ids, sizes
):
    # Multi-byte characters split across tokens as well as plain words.
    ids = token_ids + tokenizer.encode(" café — naïve 😀 ok", add_special_tokens=False)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    streamed = TextStream(tokenizer)
    deferred = TextStream(tokenizer, deferred=True)
    calls = []
    decode = tokenizer.decode

    def counting(*args, **kwargs):
        calls.append(args[0])
        return decode(*args, **kwargs)

    sizes = (*sizes, len(ids) - NUM_TOKENS)
    assert _push_all(streamed, ids, sizes) == text
    tokenizer.decode = counting
    try:
        pieces = [
            deferred.push(ids[sum(sizes[:i]) : sum(sizes[: i + 1])]) for i in range(len(sizes))
        ]
        assert pieces == [""] * len(sizes)  # nothing decoded before the output is final
        assert calls == []
        assert deferred.flush() == text == deferred.text == streamed.text
    finally:
        del tokenizer.decode
    assert calls == [ids] and deferred.kept_tokens == len(ids)  # the whole output, once
    with pytest.raises(ValueError, match="stop strings"):
        TextStream(tokenizer, ["x"], deferred=True)
