"""An OpenAPI description of the OpenAI-compatible HTTP API, for the fuzz tests.

``build_http_app`` publishes none (``app.openapi()`` has no paths: every route is registered
with ``include_in_schema=False`` and bodies are parsed by ``openai_schema``, not pydantic), so
the fuzz tests describe the API here. The ranges are the documented valid ones, except where
a case must stay cheap: ``max_tokens`` / ``max_completion_tokens`` <= 4, ``n`` <= 2, short
prompts and at most two of them. ``test_http_fuzz`` checks that the request properties below
are exactly the fields ``openai_schema`` accepts, so the description follows the API.
"""

from __future__ import annotations

MAX_TOKENS = 4  # per generated case: a case costs milliseconds
MAX_N = 2
INT64_MAX = 2**63 - 1
# Structured outputs: a few usable specs of each kind (a generated schema would mostly be one
# the grammar library refuses, which the mutated bodies and the unit tests cover).
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "integer", "minimum": 0, "maximum": 9},
    {"type": "object"},
]
REGEXES = ["[ab]{1,5}", "(yes|no)", "[0-9]+"]
GRAMMARS = ['root ::= "a" | "b" "c"?', "root ::= [0-9] [0-9]?"]
TOOL_NAMES = ["f", "g"]


def _one_key(key: str, value: dict) -> dict:
    """An object with exactly the property ``key``."""
    properties = {key: value}
    return {
        "type": "object",
        "required": [key],
        "additionalProperties": False,
        "properties": properties,
    }


def _structured_properties() -> dict:
    """response_format, vLLM's structured_outputs and guided_* (both endpoints). Choices are
    words: a few control characters no token of the tiny pair's vocabulary spells leave a
    grammar no token to draw, which the engine does not handle yet (test_openai_api's
    test_a_grammar_the_vocabulary_cannot_spell)."""
    choice = {
        "type": "array",
        "items": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "minItems": 1,
        "maxItems": 3,
    }
    json_schema = {
        "type": "object",
        "required": ["name", "schema"],
        "additionalProperties": False,
        "properties": {
            "name": {"enum": ["answer"]},
            "schema": {"enum": SCHEMAS},
            "strict": {"type": "boolean"},
            "description": {"type": "string", "maxLength": 16},
        },
    }
    return {
        "response_format": {
            "anyOf": [
                _one_key("type", {"enum": ["text", "json_object"]}),
                {
                    "type": "object",
                    "required": ["type", "json_schema"],
                    "additionalProperties": False,
                    "properties": {"type": {"enum": ["json_schema"]}, "json_schema": json_schema},
                },
            ]
        },
        "structured_outputs": {
            "anyOf": [
                _one_key("json", {"enum": SCHEMAS}),
                _one_key("regex", {"enum": REGEXES}),
                _one_key("choice", choice),
                _one_key("grammar", {"enum": GRAMMARS}),
                _one_key("json_object", {"enum": [True]}),
            ]
        },
        "guided_json": {"enum": SCHEMAS},
        "guided_regex": {"enum": REGEXES},
        "guided_choice": choice,
        "guided_grammar": {"enum": GRAMMARS},
    }


def _tool_properties() -> dict:
    """Chat's tools, tool_choice and parallel_tool_calls ("auto" is a 400 with a template that
    does not render tools, as the tiny pair's)."""
    function = {
        "type": "object",
        "required": ["name"],
        "additionalProperties": False,
        "properties": {
            "name": {"enum": TOOL_NAMES},
            "description": {"type": "string", "maxLength": 16},
            "parameters": {"enum": SCHEMAS[:1] + SCHEMAS[2:]},
            "strict": {"type": "boolean"},
        },
    }
    tool = {
        "type": "object",
        "required": ["type", "function"],
        "additionalProperties": False,
        "properties": {"type": {"enum": ["function"]}, "function": function},
    }
    named = {
        "type": "object",
        "required": ["type", "function"],
        "additionalProperties": False,
        "properties": {
            "type": {"enum": ["function"]},
            "function": _one_key("name", {"enum": TOOL_NAMES}),
        },
    }
    return {
        "tools": {"type": "array", "items": tool, "maxItems": 2},
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, named]},
        "parallel_tool_calls": {"type": "boolean"},
    }


def _sampling_properties(vocab_size: int) -> dict:
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    return {
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS},
        "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1, "maximum": vocab_size},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "logit_bias": {
            "type": "object",
            "propertyNames": {"pattern": "^[0-9]{1,5}$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            "maxProperties": 3,
        },
        "seed": {"type": "integer", "minimum": 0, "maximum": INT64_MAX},
        "ignore_eos": {"type": "boolean"},
        "stop_token_ids": {"type": "array", "items": token_id, "maxItems": 4},
        # at most the least max_tokens, so that a body the schema accepts is valid
        "min_tokens": {"type": "integer", "minimum": 0, "maximum": 1},
        "allowed_token_ids": {"type": "array", "items": token_id, "minItems": 1, "maxItems": 4},
        "prompt_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},  # not with stream
        "logprobs_mode": {"enum": ["raw", "processed", "raw_logprobs", "processed_logprobs"]},
        "include_stop_str_in_output": {"type": "boolean"},
        "stop": {
            "anyOf": [
                {"type": "string", "minLength": 1, "maxLength": 8},
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1, "maxLength": 8},
                    "maxItems": 4,
                },
            ]
        },
        "stream": {"type": "boolean"},
        "stream_options": {
            "type": "object",
            "properties": {"include_usage": {"type": "boolean"}},
            "additionalProperties": False,
        },
        "user": {"type": "string", "maxLength": 16},
        "num_speculative_tokens": {"type": "integer", "minimum": 0, "maximum": 8},
        "speculation": {"enum": ["auto", "on", "off"]},
        "timeout": {"type": "number", "exclusiveMinimum": 0, "maximum": 30},
    }


def completion_schema(vocab_size: int, model: str) -> dict:
    token_ids = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
        "minItems": 1,
        "maxItems": 8,
    }
    text = {"type": "string", "minLength": 1, "maxLength": 24}
    return {
        "type": "object",
        "required": ["model", "prompt", "max_tokens"],
        "additionalProperties": False,
        "properties": {
            "model": {"enum": [model]},
            "prompt": {
                "anyOf": [
                    text,
                    token_ids,
                    {"type": "array", "items": text, "minItems": 1, "maxItems": 2},
                    {"type": "array", "items": token_ids, "minItems": 1, "maxItems": 2},
                ]
            },
            "echo": {"type": "boolean"},
            "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "best_of": {"enum": [1]},
            "suffix": {"type": "null"},
            **_sampling_properties(vocab_size),
            **_structured_properties(),
        },
    }


def chat_schema(vocab_size: int, model: str) -> dict:
    part = {
        "type": "object",
        "required": ["type", "text"],
        "additionalProperties": False,
        "properties": {"type": {"enum": ["text"]}, "text": {"type": "string", "maxLength": 16}},
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "additionalProperties": False,
        "properties": {
            "role": {"enum": ["system", "user", "assistant", "tool"]},
            "content": {
                "anyOf": [
                    {"type": "string", "maxLength": 24},
                    {"type": "array", "items": part, "maxItems": 2},
                ]
            },
        },
    }
    return {
        "type": "object",
        "required": ["model", "messages", "max_tokens"],
        "additionalProperties": False,
        "properties": {
            "model": {"enum": [model]},
            "messages": {"type": "array", "items": message, "minItems": 1, "maxItems": 3},
            "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS},
            "logprobs": {"type": "boolean"},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},  # with logprobs
            **_sampling_properties(vocab_size),
            **_structured_properties(),
            **_tool_properties(),
        },
    }


def openapi_description(vocab_size: int, model: str) -> dict:
    """The API as OpenAPI 3.1 (request bodies are JSON Schema 2020-12, used as is)."""
    error = {
        "description": "OpenAI's error shape",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["message", "type", "param", "code"],
                            "additionalProperties": False,
                        }
                    },
                }
            }
        },
    }

    def post(schema: dict) -> dict:
        body = {"required": True, "content": {"application/json": {"schema": schema}}}
        responses = {"200": {"description": "the completion"}, "default": error}
        return {"post": {"requestBody": body, "responses": responses}}

    def get(description: str) -> dict:
        return {"get": {"responses": {"200": {"description": description}, "default": error}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "specray (OpenAI-compatible)", "version": "1"},
        "paths": {
            "/v1/completions": post(completion_schema(vocab_size, model)),
            "/v1/chat/completions": post(chat_schema(vocab_size, model)),
            "/v1/models": get("the served model"),
            "/health": get("serving"),
            "/metrics": get("Prometheus text"),
        },
    }


def request_schema(description: dict, path: str) -> dict:
    return description["paths"][path]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]


# ---- JSON Schema -> Hypothesis strategy --------------------------------------------------------
# hypothesis-jsonschema 0.23.1 (the latest) fails on Hypothesis 6.170 ('many' object has no
# attribute 'more'), so the subset of JSON Schema used above is translated here.
_KEYWORDS = {
    "type", "enum", "anyOf", "minimum", "maximum", "exclusiveMinimum", "minLength", "maxLength",
    "pattern", "items", "minItems", "maxItems", "properties", "required",
    "additionalProperties", "propertyNames", "maxProperties",
}  # fmt: skip


def strategy_for(schema: dict):
    """Values valid under ``schema`` (the keywords of ``_KEYWORDS`` only)."""
    from hypothesis import strategies as st

    unknown = set(schema) - _KEYWORDS
    if unknown:
        raise ValueError(f"unsupported JSON Schema keywords {sorted(unknown)}")
    if "anyOf" in schema:
        return st.one_of(*(strategy_for(option) for option in schema["anyOf"]))
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    low, high = schema.get("minimum"), schema.get("maximum")
    above = schema.get("exclusiveMinimum")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.integers(above + 1 if above is not None else low, high)
    if kind == "number":
        floats = st.floats(above if above is not None else low, high, exclude_min=above is not None)
        integers = st.integers(above + 1 if above is not None else low, high)
        return st.one_of(floats, integers)  # a JSON integer is a number too
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        return st.text(min_size=schema.get("minLength", 0), max_size=schema.get("maxLength"))
    if kind == "array":
        return st.lists(
            strategy_for(schema["items"]),
            min_size=schema.get("minItems", 0),
            max_size=schema.get("maxItems"),
        )
    if kind == "object":
        properties = schema.get("properties", {})
        required = set(schema.get("required", ()))
        known = st.fixed_dictionaries(
            {name: strategy_for(properties[name]) for name in sorted(required)},
            optional={
                name: strategy_for(sub) for name, sub in properties.items() if name not in required
            },
        )
        extra = schema.get("additionalProperties", False)
        if extra is False:
            return known
        keys = strategy_for({"type": "string", **schema.get("propertyNames", {})})
        return st.dictionaries(
            keys, strategy_for(extra), max_size=schema.get("maxProperties")
        ).flatmap(lambda more: known.map(lambda values: {**more, **values}))
    raise ValueError(f"unsupported JSON Schema {schema}")
