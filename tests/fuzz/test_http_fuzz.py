"""The OpenAI HTTP API fuzzed in process (httpx's ASGI transport, on the backend's loop) over a
real :class:`LocalBackend` on the tiny chat pair: bodies generated from the API's OpenAPI
description (:mod:`tests.fuzz.openapi_doc`), the same bodies with fields replaced by arbitrary
JSON, random JSON documents, random bytes under random content types, odd JSON texts, random
methods and paths, and random credentials.

Every response: no 5xx (save the documented 504 when the body set a ``timeout``), every error
in OpenAI's shape ``{"error": {message, type, param, code}}``, no traceback or path in any
body, stream errors never ``internal_error``; and the app still serves afterwards.

The bugs this found (lone surrogates, odd logit_bias keys, huge ints, one bad request failing
its round) are fixed; the regression tests at the bottom pin them.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
from hypothesis import currently_in_test_context, event, given
from hypothesis import strategies as st

from specray.serve.openai_api import MAX_BODY_BYTES
from specray.serve.openai_schema import (
    CHAT_FIELDS,
    COMMON_FIELDS,
    COMPLETION_FIELDS,
    SAMPLING_FIELDS,
    SPECRAY_FIELDS,
    VLLM_FIELDS,
)
from tests.fuzz.budget import fuzz_settings
from tests.fuzz.conftest import MODEL, TOKEN, HttpResult
from tests.fuzz.openapi_doc import openapi_description, request_schema, strategy_for

VOCAB = 49_152  # the tiny chat pair's (the bundled tokenizer's) vocabulary
DESCRIPTION = openapi_description(VOCAB, MODEL)
LEAK_MARKERS = ("Traceback", '.py"', "/work/", "site-packages")
ERROR_KEYS = {"message", "type", "param", "code"}
ROUTES = ("/v1/completions", "/v1/chat/completions")
BASE_BODIES = {
    "/v1/completions": {"model": MODEL, "prompt": "Hello there", "max_tokens": 2},
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
    },
}
SERVE_TIMEOUT_S = 10.0  # for the coordinator to be idle again after a test


# ---- sending and judging ---------------------------------------------------------------------
def _json_bytes(body) -> bytes:
    """JSON text as clients may send it: NaN / Infinity literals, lone surrogates escaped."""
    return json.dumps(body).encode()


def _parsed(raw: bytes):
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _strict_json(text: str):
    """JSON as the standard has it: NaN and +-Infinity (Python's extension, what -inf
    log-probabilities would become) are failures."""

    def refuse(literal: str):
        raise AssertionError(f"{literal} is not JSON, in {text[:300]!r}")

    return json.loads(text, parse_constant=refuse)


def _sse_events(text: str) -> list:
    events = []
    for block in text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block[:200]
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else _strict_json(data))
    return events


def _assert_error_shape(error: dict, context: str) -> None:
    assert set(error) == ERROR_KEYS, context
    assert isinstance(error["message"], str) and error["message"], context
    assert isinstance(error["type"], str) and error["type"], context
    assert error["param"] is None or isinstance(error["param"], str), context


def _note(label: str) -> None:
    if currently_in_test_context():  # Hypothesis statistics; plain tests have none
        event(label)


def check(result: HttpResult, tally, *, method: str = "POST", body=None, raw: bytes = b"") -> None:
    """Judge one response to a request with (parsed) ``body``."""
    _note(f"HTTP {result.status}")
    context = f"{method} -> {result.status}: {result.content[:300]!r} for {raw[:300]!r}"
    text = result.content.decode("utf-8", "replace")
    for marker in LEAK_MARKERS:
        assert marker not in text, context
    timed_out = isinstance(body, dict) and body.get("timeout") is not None
    if result.status >= 500:
        if result.status == 504 and timed_out:
            _note("504: the request's own timeout")  # documented, not a fault
        else:
            tally.server_error()
            raise AssertionError(context)
    if method == "HEAD":
        return
    if result.status >= 400:
        payload = _parsed(result.content)
        assert isinstance(payload, dict) and set(payload) == {"error"}, context
        _assert_error_shape(payload["error"], context)
        if result.status == 504:
            assert payload["error"]["type"] == "timeout_error", context
        return
    content_type = result.headers.get("content-type", "")
    if content_type.startswith("text/event-stream"):
        events = _sse_events(text)
        for item in events:
            if isinstance(item, dict) and "error" in item:  # a stream cut by an error
                _assert_error_shape(item["error"], context)
                if item["error"]["type"] != "timeout_error" or not timed_out:
                    tally.server_error()
                    raise AssertionError(context)
                return
        assert events and events[-1] == "[DONE]", context
    elif content_type.startswith("application/json"):
        payload = _strict_json(text)
        if "choices" in payload:
            assert payload["choices"], context
            for choice in payload["choices"]:
                assert choice["finish_reason"] in ("stop", "length", "tool_calls"), context
                for call in (choice.get("message") or {}).get("tool_calls") or ():
                    assert call["id"].startswith("call_") and call["type"] == "function", context
                    assert isinstance(call["function"]["arguments"], str), context


def post(served, path: str, raw: bytes, *, content_type: str | None = "application/json"):
    # Header bytes as they arrive on the wire (latin-1, as ASGI servers decode them).
    headers = {"content-type": content_type.encode("latin-1")} if content_type is not None else {}
    return served.http("POST", path, content=raw, headers=headers)


@pytest.fixture
def serving_after(served):
    """After the test: the app answers /health and a valid completion; nothing left running."""
    yield
    _assert_serving(served)


def _assert_serving(served) -> None:
    assert served.http("GET", "/health").status == 200
    result = post(served, "/v1/completions", _json_bytes(BASE_BODIES["/v1/completions"]))
    assert result.status == 200, result.content
    assert json.loads(result.content)["choices"][0]["finish_reason"] in ("stop", "length")
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while not served.idle():
        assert time.monotonic() < deadline, "requests were left running"
        time.sleep(0.05)


# ---- the description ---------------------------------------------------------------------------
def test_description_covers_every_accepted_field():
    common = COMMON_FIELDS | SPECRAY_FIELDS | VLLM_FIELDS | set(SAMPLING_FIELDS)
    for path, fields in (
        ("/v1/completions", common | COMPLETION_FIELDS),
        ("/v1/chat/completions", common | CHAT_FIELDS),
    ):
        assert set(request_schema(DESCRIPTION, path)["properties"]) == fields, path


# ---- strategies ----------------------------------------------------------------------------------
schema_calls = st.one_of(
    *(
        strategy_for(request_schema(DESCRIPTION, path)).map(lambda b, p=path: (p, b))
        for path in ROUTES
    )
)
text = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(codec="utf-8"), max_size=12),
    st.sampled_from(
        ["", " ", "\x00", "\u202e", "\U0001f600", "\u00b2", "\u0663", "\ud800", "a\udfffb"]
    ),  # the last two: lone surrogates (valid JSON escapes, not UTF-8-encodable)
    st.integers(4301, 5000).map(lambda size: "9" * size),  # past int()'s digit limit
)
numbers = st.one_of(
    st.integers(),
    st.floats(),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 1e308, 5e-324]),
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, text),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(text, children, max_size=4)
    ),
    max_leaves=10,
)
ACCEPTED_FIELDS = (
    COMMON_FIELDS
    | SPECRAY_FIELDS
    | VLLM_FIELDS
    | COMPLETION_FIELDS
    | CHAT_FIELDS
    | set(SAMPLING_FIELDS)
)
field_names = st.one_of(st.sampled_from(sorted(ACCEPTED_FIELDS)), text)


@st.composite
def mutated_calls(draw):
    """A valid body (base or generated) with one to three fields replaced, added or removed."""
    path = draw(st.sampled_from(ROUTES))
    body = dict(
        draw(st.one_of(st.just(BASE_BODIES[path]), strategy_for(request_schema(DESCRIPTION, path))))
    )
    for _ in range(draw(st.integers(1, 3))):
        name = draw(field_names)
        if draw(st.integers(0, 4)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(json_values)
    return path, body


# ---- the fuzz tests ------------------------------------------------------------------------------
@fuzz_settings(60)
@given(call=schema_calls)
def test_bodies_from_the_description(served, tally, serving_after, call):
    path, body = call
    tally.case()
    raw = _json_bytes(body)
    check(post(served, path, raw), tally, body=body, raw=raw)


@fuzz_settings(100)
@given(call=mutated_calls())
def test_bodies_with_arbitrary_field_values(served, tally, serving_after, call):
    path, body = call
    tally.case()
    raw = _json_bytes(body)
    check(post(served, path, raw), tally, body=body, raw=raw)


@fuzz_settings(40)
@given(path=st.sampled_from(ROUTES), body=json_values)
def test_arbitrary_json_documents(served, tally, serving_after, path, body):
    tally.case()
    raw = _json_bytes(body)
    check(post(served, path, raw), tally, body=body, raw=raw)


content_types = st.one_of(
    st.none(),
    st.sampled_from(
        [
            "application/json",
            "application/json; charset=latin-1",
            "application/vnd.api+json",
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "",
            ";",
            "application/json\t;;;==",
        ]
    ),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=20),
)


@fuzz_settings(40)
@given(path=st.sampled_from(ROUTES), raw=st.binary(max_size=300), content_type=content_types)
def test_random_bytes_under_any_content_type(served, tally, serving_after, path, raw, content_type):
    tally.case()
    check(post(served, path, raw, content_type=content_type), tally, body=_parsed(raw), raw=raw)


ODD_JSON_TEXTS = [
    b"",
    b"null",
    b"[]",
    b'"just a string"',
    b"{",
    b"{}" * 3,
    b"\xef\xbb\xbf{}",  # a UTF-8 byte-order mark
    b"[" * 100_000 + b"]" * 100_000,  # nesting deeper than the recursion limit
    b'{"model": "tiny", "prompt": "x", "max_tokens": 1e999999}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": NaN}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "timeout": Infinity}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "max_tokens": 3}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "seed": -0}',
    b'{"model": "tiny", "prompt": "\\u0000", "max_tokens": 2}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "timeout": 1e-300}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "n": 128}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "n": 129}',
    b'{"model": "tiny", "prompt": [[1], [2]], "max_tokens": 2, "n": 64}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 1000000}',
    b'{"model": "tiny", "prompt": [49152], "max_tokens": 2}',
    b'{"model": "tiny", "prompt": [-1], "max_tokens": 2}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "stop": ["a","b","c","d","e","f","g",'
    b'"h","i","j","k","l","m","n","o","p","q"]}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "stop": [""]}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": true, '
    b'"stream_options": {"include_usage": true}}',
    b'{"model": "tiny", "messages": [], "max_tokens": 2}',
    b'{"model": "tiny", "messages": [{"role": "tool", "content": "x"}], "max_tokens": 2}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}',  # runs to the context
    b'{"model": "\xff\xfe", "prompt": "x"}',  # not UTF-8
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": 18446744073709551616}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": 1' + b"0" * 400 + b"}",
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "repetition_penalty": 1' + b"0" * 30 + b"}",
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2}' + b" " * (MAX_BODY_BYTES + 1),
]


def test_odd_json_texts(served, tally, serving_after):
    for raw in ODD_JSON_TEXTS:
        for path in ROUTES:
            tally.case()
            check(post(served, path, raw), tally, body=_parsed(raw), raw=raw)


@fuzz_settings(30)
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]),
    path=st.one_of(
        st.sampled_from([*DESCRIPTION["paths"], "/", "/v1", "/docs", "/openapi.json",
                         "/v1/completions/", "//v1/models", "/v1/../health"]),
        st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20).map(
            lambda s: "/" + s.replace("?", "").replace("#", "")
        ),
    ),
)  # fmt: skip
def test_any_method_on_any_path(served, tally, serving_after, method, path):
    tally.case()
    result = served.http(method, path, content=b"{}" if method in ("POST", "PUT") else None)
    check(result, tally, method=method, raw=f"{method} {path}".encode())


@fuzz_settings(30)
@given(
    path=st.sampled_from(["/v1/models", "/metrics", "/v1/completions"]),
    authorization=st.one_of(
        st.none(),
        st.sampled_from(["", "Bearer", "Bearer ", f"bearer {TOKEN}x", f"Basic {TOKEN}",
                         f"Bearer {TOKEN[:-1]}", f"Bearer  {TOKEN} extra"]),
        st.binary(max_size=40).map(lambda b: b"Bearer " + re.sub(rb"[\r\n]", b"", b)),
    ),
)  # fmt: skip
def test_credentials_are_checked_without_leaks(served, tally, serving_after, path, authorization):
    tally.case()
    headers = {"authorization": authorization} if authorization is not None else {}
    method = "POST" if path == "/v1/completions" else "GET"
    raw = _json_bytes(BASE_BODIES["/v1/completions"])
    result = served.http(method, path, app="auth", headers=headers, content=raw)
    check(result, tally, method=method, raw=repr(authorization).encode())
    assert result.status == 401, result.content
    assert result.headers.get("www-authenticate") == "Bearer"


def test_health_needs_no_credentials_and_the_right_token_works(served):
    assert served.http("GET", "/health", app="auth").status == 200
    body = _json_bytes(BASE_BODIES["/v1/completions"])
    headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    result = served.http("POST", "/v1/completions", app="auth", headers=headers, content=body)
    assert result.status == 200, result.content


# ---- fixed bugs: regression tests ----------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "prompt": "\ud800", "max_tokens": 2},
        {"model": MODEL, "messages": [{"role": "user", "content": "a\udfff"}], "max_tokens": 2},
        {"model": MODEL, "prompt": "x", "max_tokens": 2, "\ud800": 1},
    ],
    ids=["prompt", "chat-content", "field-name"],
)
def test_lone_surrogate_is_400(served, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    result = post(served, path, _json_bytes(body))
    assert result.status == 400, (result.status, result.content)
    error = json.loads(result.content)["error"]
    assert error["param"] in (None, "prompt", "messages"), error


@pytest.mark.parametrize("key", ["\u00b2", "9" * 5000])
def test_unicode_digit_bias_key_is_400(served, key):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "logit_bias": {key: 1}}
    result = post(served, "/v1/completions", _json_bytes(body))
    assert result.status == 400, (result.status, result.content)
    assert json.loads(result.content)["error"]["param"] == "logit_bias"


@pytest.mark.parametrize("value", [2**64, 10**400])
def test_huge_int_temperature_is_400(served, value):
    """2**64 used to pass validation, then overflow the target's pipeline (503 for the whole
    round); 10**400 failed validation with a 500."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": value}
    result = post(served, "/v1/completions", _json_bytes(body))
    assert result.status == 400, (result.status, result.content)
    assert json.loads(result.content)["error"]["param"] == "temperature"


def test_a_bad_request_does_not_fail_its_neighbours(served):
    """Innocent requests decoding alongside one with temperature = 2**64 must still finish."""
    good = _json_bytes({"model": MODEL, "prompt": "Hello", "max_tokens": 80, "ignore_eos": True})
    bad = _json_bytes({"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 2**64})
    headers = {"content-type": "application/json"}

    async def together():
        client = served.clients["open"]
        innocent = [
            asyncio.ensure_future(client.post("/v1/completions", content=good, headers=headers))
            for _ in range(3)
        ]
        await asyncio.sleep(0.1)  # they are decoding now (80 tokens take longer)
        await client.post("/v1/completions", content=bad, headers=headers)
        return [(await request).status_code for request in innocent]

    assert served.run(together()) == [200, 200, 200]
