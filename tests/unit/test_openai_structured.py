"""Structured outputs and tool calls at the HTTP edge, as pure functions: request fields to one
constraint (:mod:`specray.serve.openai_structured`), and generated text to tool calls
(:mod:`specray.serve.openai_tools`), streamed piece by piece or read whole."""

from __future__ import annotations

import json

import pytest

from specray.errors import InvalidRequestError
from specray.serve.openai_structured import (
    NO_PARAMETERS,
    output_constraint,
    required_schema,
    tool_calling,
)
from specray.serve.openai_tools import NamedCall, RequiredCalls, TaggedCalls

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "description": "The time."}},
]


def _error(function, body: dict) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as raised:
        function(body)
    return raised.value


# ---- request fields -> one constraint --------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, ("json_object", "")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "w", "schema": WEATHER, "strict": True},
                }
            },
            ("json", json.dumps(WEATHER)),
        ),
        ({"structured_outputs": {"json": WEATHER}}, ("json", json.dumps(WEATHER))),
        ({"structured_outputs": {"json": '{"type": "integer"}'}}, ("json", '{"type": "integer"}')),
        ({"structured_outputs": {"regex": "[ab]{1,5}"}}, ("regex", "[ab]{1,5}")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, ("choice", '["yes", "no"]')),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, ("grammar", 'root ::= "a"')),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
            ("json_object", ""),
        ),
        ({"guided_json": WEATHER}, ("json", json.dumps(WEATHER))),
        ({"guided_regex": "a+"}, ("regex", "a+")),
        ({"guided_choice": ["x"]}, ("choice", '["x"]')),
        ({"guided_grammar": 'root ::= "a"'}, ("grammar", 'root ::= "a"')),
        ({"guided_regex": None, "response_format": None}, None),  # null: unset
    ],
)
def test_each_spelling_gives_its_constraint(body, expected):
    constraint = output_constraint(body)
    assert (constraint and constraint.structured_outputs) == expected


@pytest.mark.parametrize(
    ("body", "param", "shown"),
    [
        ({"response_format": "json"}, "response_format", "'json'"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
        ({"response_format": {"type": "text", "schema": {}}}, "response_format.schema", ""),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
            "None",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}},
            "response_format.json_schema.schema",
            "required",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "w", "schema": {"type": "nonsense"}},
                }
            },
            "response_format.json_schema.schema",
            "nonsense",
        ),
        ({"structured_outputs": {"regex": "[ab"}}, "structured_outputs.regex", "Unclosed"),
        ({"structured_outputs": {"regex": r"(a)\1"}}, "structured_outputs.regex", "Backreference"),
        (
            {"structured_outputs": {"grammar": "root ::= rule"}},
            "structured_outputs.grammar",
            "rule",
        ),
        ({"structured_outputs": {"json": '{"type":'}}, "structured_outputs.json", "not JSON"),
        ({"structured_outputs": {"json": 3}}, "structured_outputs.json", "3"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "[]"),
        ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice", "1"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object", "False"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "choice"),
        ({"structured_outputs": {}}, "structured_outputs", "none"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", ""),
        ({"guided_regex": ""}, "guided_regex", "''"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "both"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "both"),
    ],
)
def test_bad_constraints_name_the_field_and_show_why(body, param, shown):
    error = _error(output_constraint, body)
    assert error.param == param, error.message
    assert shown in error.message and param in error.message
    assert ".cc:" not in error.message  # the grammar library's source location is not shown


# ---- tools -> a constraint --------------------------------------------------------------------
def test_tool_choices():
    assert tool_calling({}) is None
    assert tool_calling({"tools": [], "tool_choice": "auto"}) is None  # what SDKs send
    assert tool_calling({"tool_choice": "none"}) is None
    shown = tool_calling({"tools": TOOLS, "tool_choice": "none"})
    assert (shown.mode, shown.constraint, shown.tools) == ("none", None, tuple(TOOLS))
    assert tool_calling({"tools": TOOLS}).mode == "auto"  # OpenAI's default with tools
    named = tool_calling(
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "weather"}}}
    )
    assert (named.mode, named.name) == ("named", "weather")
    assert named.constraint.structured_outputs == ("json", json.dumps(WEATHER))
    assert named.constraint.field == "tools[0].function.parameters"
    bare = tool_calling(
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}}}
    )
    assert json.loads(bare.constraint.spec) == NO_PARAMETERS  # arguments "{}" only
    required = tool_calling(
        {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    )
    assert json.loads(required.constraint.spec) == required_schema(
        {"weather": WEATHER, "now": NO_PARAMETERS}, parallel=False
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": "weather"}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]},
            "tools[0].function.extra",
        ),
        ({"tools": [*TOOLS, TOOLS[0]]}, "tools[2].function.name"),  # two tools named alike
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "code", "function": {"name": "now"}}},
            "tool_choice.type",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"},
            "parallel_tool_calls",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tools_name_the_field(body, param):
    assert _error(tool_calling, body).param == param


def test_required_schema_moves_definitions_to_the_root():
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    uses = {
        "type": "object",
        "properties": {"at": {"$ref": "#/$defs/point"}},
        "$defs": {"point": point},
    }
    schema = required_schema({"move": uses, "stay": NO_PARAMETERS})
    assert schema["$defs"] == {"point": point}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]] == [
        ["move"],
        ["stay"],
    ]
    assert (schema["minItems"], "maxItems" in schema) == (1, False)
    other = {**uses, "$defs": {"point": {"type": "string"}}}
    with pytest.raises(ValueError, match="point"):
        required_schema({"a": uses, "b": other})


# ---- generated text -> tool calls ------------------------------------------------------------
def _streamed(parser, pieces):
    """Push ``pieces`` then flush; the deltas merged per call as an OpenAI client merges them."""
    content, calls = "", {}
    for piece in [*pieces, None]:
        text, deltas = parser.flush() if piece is None else parser.push(piece)
        content += text
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = delta.get("id", call["id"])
            call["name"] = delta.get("function", {}).get("name", call["name"])
            call["arguments"] += delta["function"].get("arguments", "")
    return content, [calls[index] for index in sorted(calls)]


def _whole(calls):
    return [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in calls
    ]


REQUIRED_TEXT = (
    '[{"name": "weather", "parameters": {"city": "Paris", "days": 3}}, '
    '{"name": "now", "parameters": {}}]'
)


@pytest.mark.parametrize("size", [1, 2, 7, len(REQUIRED_TEXT)])
def test_required_calls_streamed_in_any_pieces(size):
    parser = RequiredCalls()
    pieces = [REQUIRED_TEXT[i : i + size] for i in range(0, len(REQUIRED_TEXT), size)]
    content, streamed = _streamed(parser, pieces)
    assert content == "" and parser.complete
    assert streamed == _whole(parser.calls)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        ("weather", {"city": "Paris", "days": 3}),
        ("now", {}),
    ]
    assert streamed[0]["arguments"] == '{"city": "Paris", "days": 3}'  # as generated, no blank
    assert all(c["id"].startswith("call_") for c in streamed)
    assert parser.finish_reason("stop") == "tool_calls"
    assert parser.message() == {"role": "assistant", "content": None, "tool_calls": parser.calls}


def test_a_cut_required_output_keeps_its_reason():
    parser = RequiredCalls()
    parser.push(REQUIRED_TEXT[:75])  # inside the second call's name
    parser.flush()
    assert [c["function"]["name"] for c in parser.calls] == ["weather"]
    assert not parser.complete and parser.finish_reason("length") == "length"
    parser = RequiredCalls()
    parser.push('[{"name": "weather", "parameters": {"city": "Pa')
    assert parser.calls[0]["function"]["arguments"] == '{"city": "Pa'  # as far as generated
    assert parser.finish_reason("stop") == "stop"  # (a stop string cut it)


def test_a_named_call_is_the_whole_output():
    parser = NamedCall("weather")
    first = parser.push("")  # announced at once
    assert first == ("", [{"index": 0, "id": parser.calls[0]["id"], "type": "function",
                           "function": {"name": "weather", "arguments": ""}}])  # fmt: skip
    assert parser.push('{"city": ') == ("", [{"index": 0, "function": {"arguments": '{"city": '}}])
    assert not parser.complete and parser.finish_reason("length") == "length"
    parser.push('"Rome", "days": 1}')
    assert parser.complete and parser.finish_reason("stop") == "tool_calls"
    assert parser.calls[0]["function"]["arguments"] == '{"city": "Rome", "days": 1}'


def test_tagged_calls_among_content():
    call = '{"name": "weather", "arguments": {"city": "Rome"}}'
    text = f"Let me check.\n<tool_call>\n{call}\n</tool_call>"
    text += "\n<tool_call>not json</tool_call> done <tool"
    for size in (1, 3, len(text)):
        parser = TaggedCalls()
        content, streamed = _streamed(
            parser, [text[i : i + size] for i in range(0, len(text), size)]
        )
        assert content == parser.content
        assert content == "Let me check.\n\n<tool_call>not json</tool_call> done <tool"
        assert streamed == _whole(parser.calls)
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
            ("weather", {"city": "Rome"})
        ]
        assert parser.complete and parser.finish_reason("stop") == "tool_calls"
    cut = TaggedCalls()
    cut.push('<tool_call>{"name": "now"')
    assert cut.flush() == ('<tool_call>{"name": "now"', [])
    assert not cut.complete and cut.message() == {
        "role": "assistant",
        "content": '<tool_call>{"name": "now"',
    }
    plain = TaggedCalls()
    plain.push("Just text.")
    plain.flush()
    assert plain.finish_reason("stop") == "stop" and "tool_calls" not in plain.message()


# ---- chat templates and tools ----------------------------------------------------------------
# A template that shows the tools (as Qwen's and SmolLM3's do, much shortened).
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>"
    "{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tools_reach_templates_that_render_them():
    import copy

    from specray.models.loading import load_tokenizer, resolve_model_dir
    from specray.prompts import prompt_token_ids, template_renders_tools

    bundled = load_tokenizer(resolve_model_dir("default"))
    assert not template_renders_tools(bundled)  # SmolLM2's template ignores tools
    turns = [{"role": "user", "content": "Weather in Rome?"}]
    with_tools = copy.copy(bundled)
    with_tools.chat_template = TOOL_TEMPLATE
    assert template_renders_tools(with_tools)
    plain = prompt_token_ids(with_tools, turns, use_chat_template=True)
    shown = prompt_token_ids(with_tools, turns, use_chat_template=True, tools=TOOLS)
    assert "Tools: weather now" in with_tools.decode(shown) and len(shown) > len(plain)
    without = copy.copy(bundled)
    without.chat_template = None
    assert not template_renders_tools(without)
