"""Structured outputs and tool calls as OpenAI and vLLM clients ask for them: request fields in,
at most one grammar for the output out (:class:`Constraint`, SamplingParams'
``structured_outputs``). Plain dicts, no web framework; compiling is checked with xgrammar
(imported on first use), so that an unusable spec is a 400 naming the user's own field.

Fields, on both endpoints unless said:

- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any
  JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}}`` (the schema is enforced whatever ``strict`` says).
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, as an object or its JSON
  text), ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF, xgrammar's dialect) or
  ``json_object: true``; ``disable_any_whitespace`` is accepted (JSON is generated without
  free whitespace either way).
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.
- chat: ``tools`` (OpenAI function tools), ``tool_choice`` and ``parallel_tool_calls``
  (:func:`tool_calling`).

One constraint per call: two are a 400 naming the second.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specray.sampling.grammar_spec import GrammarError
from specray.serve.openai_fields import boolean, invalid, non_empty_string, obj, show, string

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")  # of response_format.json_schema
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's keys
STRUCTURED_OUTPUT_OPTIONS = ("disable_any_whitespace",)  # accepted: JSON is compact anyway
GUIDED_FIELDS = {  # vLLM's older fields -> kind
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_FIELDS = {"structured_outputs", *GUIDED_FIELDS}  # vLLM's, on both endpoints
# The body fields that can make parsing compile a grammar (slow enough to leave the loop for).
CONSTRAINT_FIELDS = frozenset({"response_format", "tools", "tool_choice", *STRUCTURED_FIELDS})
TOOL_CHOICES = ("none", "auto", "required")  # and a named function: mode "named"
TOOL_KEYS = ("type", "function")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")
# A function without a parameters schema takes none: its arguments are "{}" (OpenAI's rule).
NO_PARAMETERS = {"type": "object", "properties": {}}
SCHEMA_DEFINITIONS = ("$defs", "definitions")  # hoisted to the root of the "required" schema
# xgrammar's messages begin "[hh:mm:ss] /its/source.cc:123: ": the client is told the rest.
LIBRARY_LOCATION = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")


@dataclass(frozen=True)
class Constraint:
    """One grammar for the output: SamplingParams' ``structured_outputs`` = ``(kind, spec)``,
    and the request field it came from (errors name it)."""

    kind: str  # specray.sampling.grammar_spec.KINDS
    spec: str
    field: str

    @property
    def structured_outputs(self) -> tuple[str, str]:
        return (self.kind, self.spec)


def check_compiles(constraint: Constraint) -> Constraint:
    """``constraint``, once the grammar library built it (no tokenizer needed: cheap, and
    cached by spec); else a 400 naming its field and showing the value and the reason."""
    from specray.sampling.grammar import check_compiles as compiles  # (torch: imported late)

    try:
        compiles(constraint.kind, constraint.spec)
    except GrammarError as error:
        field, reason = constraint.field, LIBRARY_LOCATION.sub("", str(error))
        raise invalid(field, f"{field}={show(constraint.spec)} cannot be used: {reason}") from None
    return constraint


# ---- response_format, structured_outputs, guided_* ------------------------------------------
def _unknown_keys(name: str, value: Mapping, known) -> None:
    unknown = sorted(set(value) - set(known), key=str)
    if unknown:
        raise invalid(
            f"{name}.{unknown[0]}",
            f"{name}.{unknown[0]} is not supported; {name} takes {sorted(known)}",
        )


def _response_format(value: Any) -> Constraint | None:
    fmt = obj("response_format", value)
    kind = fmt.get("type")
    if kind not in RESPONSE_FORMATS:
        raise invalid(
            "response_format.type",
            f"response_format.type must be one of {list(RESPONSE_FORMATS)}, got {show(kind)}",
        )
    _unknown_keys(
        "response_format", fmt, ("type", "json_schema") if kind == "json_schema" else ("type",)
    )
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "", "response_format")
    name = "response_format.json_schema"
    if fmt.get("json_schema") is None:
        raise invalid(name, f"{name} is required with type json_schema")
    config = obj(name, fmt["json_schema"])
    _unknown_keys(name, config, JSON_SCHEMA_KEYS)
    non_empty_string(f"{name}.name", config.get("name"))
    if config.get("description") is not None:
        string(f"{name}.description", config["description"])
    if config.get("strict") is not None:
        boolean(f"{name}.strict", config["strict"])
    if config.get("schema") is None:
        raise invalid(f"{name}.schema", f"{name}.schema is required: the JSON schema to follow")
    schema = obj(f"{name}.schema", config["schema"])
    return Constraint("json", json.dumps(schema), f"{name}.schema")


def _spec(field: str, kind: str, value: Any) -> Constraint:
    """vLLM's spelling of one constraint (``structured_outputs.<kind>`` or ``guided_<kind>``)."""
    if kind == "json":
        if isinstance(value, dict):
            return Constraint("json", json.dumps(value), field)
        if isinstance(value, str):  # the schema's JSON text (checked when compiled)
            return Constraint("json", value, field)
        raise invalid(
            field, f"{field} must be a JSON schema (an object or its text), got {show(value)}"
        )
    if kind == "json_object":
        if value is not True:
            raise invalid(
                field, f"{field} must be true (omit it for no constraint), got {show(value)}"
            )
        return Constraint("json_object", "", field)
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(item, str) and item for item in value)
        ):
            raise invalid(
                field, f"{field} must be a non-empty list of non-empty strings, got {show(value)}"
            )
        return Constraint("choice", json.dumps(value), field)
    return Constraint(kind, non_empty_string(field, value), field)  # regex, grammar


def _structured_outputs(value: Any) -> Constraint:
    options = obj("structured_outputs", value)
    _unknown_keys(
        "structured_outputs", options, STRUCTURED_OUTPUT_KINDS + STRUCTURED_OUTPUT_OPTIONS
    )
    for option in STRUCTURED_OUTPUT_OPTIONS:
        if options.get(option) is not None:
            boolean(f"structured_outputs.{option}", options[option])
    given = [kind for kind in STRUCTURED_OUTPUT_KINDS if options.get(kind) is not None]
    if len(given) != 1:
        raise invalid(
            "structured_outputs",
            f"structured_outputs must set exactly one of {list(STRUCTURED_OUTPUT_KINDS)}, "
            f"got {given or 'none'}",
        )
    kind = given[0]
    return _spec(f"structured_outputs.{kind}", kind, options[kind])


def output_constraint(body: Mapping) -> Constraint | None:
    """The call's constraint from ``response_format``, ``structured_outputs`` or a
    ``guided_*`` field, compiled; None without one."""
    found = []
    if body.get("response_format") is not None:
        found.append(_response_format(body["response_format"]))
    if body.get("structured_outputs") is not None:
        found.append(_structured_outputs(body["structured_outputs"]))
    for field, kind in GUIDED_FIELDS.items():
        if body.get(field) is not None:
            found.append(_spec(field, kind, body[field]))
    found = [constraint for constraint in found if constraint is not None]
    if len(found) > 1:
        first, second = found[0].field, found[1].field
        raise invalid(second, f"{first} and {second} both constrain the output; send one of them")
    return check_compiles(found[0]) if found else None


# ---- tools ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCalling:
    """What a chat call's ``tools`` and ``tool_choice`` ask for.

    ``mode``: "none" (no constraint; the tools are only shown to the model), "auto" (the model
    decides: only where the chat template renders tools), "named" (the output is the arguments
    of the function ``name``, constrained by its parameters schema) or "required" (a JSON array
    of one or more ``{"name", "parameters"}`` objects, one per call; one at most with
    ``parallel_tool_calls: false``).
    """

    tools: tuple[Mapping[str, Any], ...]  # OpenAI tool objects, for the chat template
    mode: str
    name: str | None = None  # mode "named": the function
    constraint: Constraint | None = None  # modes "named" and "required": the output's grammar


def _functions(tools: Any) -> dict[str, tuple[int, dict]]:
    """``tools`` checked: function name -> (its index in tools, its parameters schema)."""
    if not isinstance(tools, list):
        raise invalid("tools", f"tools must be a list of function tools, got {show(tools)}")
    functions: dict[str, tuple[int, dict]] = {}
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        obj(where, tool)
        _unknown_keys(where, tool, TOOL_KEYS)
        if tool.get("type") != "function":
            raise invalid(
                f"{where}.type", f'{where}.type must be "function", got {show(tool.get("type"))}'
            )
        function = obj(f"{where}.function", tool.get("function"))
        _unknown_keys(f"{where}.function", function, FUNCTION_KEYS)
        name = non_empty_string(f"{where}.function.name", function.get("name"))
        if name in functions:
            raise invalid(f"{where}.function.name", f"two tools are named {name!r}")
        if function.get("description") is not None:
            string(f"{where}.function.description", function["description"])
        if function.get("strict") is not None:
            boolean(f"{where}.function.strict", function["strict"])
        parameters = function.get("parameters")
        if parameters is None:
            parameters = NO_PARAMETERS
        functions[name] = (index, obj(f"{where}.function.parameters", parameters))
    return functions


def _named(choice: Any) -> str:
    """The function a ``tool_choice`` object names."""
    choice = obj("tool_choice", choice)
    _unknown_keys("tool_choice", choice, ("type", "function"))
    if choice.get("type") != "function":
        raise invalid(
            "tool_choice.type",
            f'tool_choice.type must be "function", got {show(choice.get("type"))}',
        )
    function = obj("tool_choice.function", choice.get("function"))
    _unknown_keys("tool_choice.function", function, ("name",))
    return non_empty_string("tool_choice.function.name", function.get("name"))


def required_schema(functions: Mapping[str, dict], *, parallel: bool = True) -> dict:
    """The JSON schema of ``tool_choice: "required"`` (vLLM's): an array of one or more calls
    ``{"name": <a tool's name>, "parameters": <that tool's schema>}`` (at most one unless
    ``parallel``). Each tool's ``$defs`` / ``definitions`` move to the root, where its
    ``#/$defs/...`` references now resolve; two tools defining one name differently are a
    ValueError naming it."""
    definitions: dict[str, dict] = {}
    options = []
    for name, parameters in functions.items():
        parameters = dict(parameters)
        for key in SCHEMA_DEFINITIONS:
            for label, definition in (parameters.pop(key, None) or {}).items():
                if definitions.setdefault(key, {}).setdefault(label, definition) != definition:
                    raise ValueError(f"{key} {label!r} is defined differently by two tools")
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    return schema | definitions


def tool_calling(body: Mapping) -> ToolCalling | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat call (None: no tools
    and no tool call). Without ``tool_choice``, tools mean "auto" (OpenAI's default)."""
    tools = body.get("tools")
    functions = _functions([] if tools is None else tools)
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else boolean("parallel_tool_calls", parallel)
    choice = body.get("tool_choice")
    name = None
    if choice is None:
        mode = "auto" if functions else "none"
    elif isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise invalid(
                "tool_choice",
                f"tool_choice must be one of {list(TOOL_CHOICES)} or "
                f'{{"type": "function", "function": {{"name": ...}}}}, got {show(choice)}',
            )
        mode = choice
    else:
        mode, name = "named", _named(choice)
    if mode == "auto" and not functions:  # what SDKs send with no tools: nothing to call
        mode = "none"
    if mode == "none":
        return ToolCalling(tuple(tools), mode) if functions else None
    if not functions:
        raise invalid("tool_choice", f"tool_choice={show(choice)} needs tools, and none are given")
    constraint = None
    if mode == "named":
        if name not in functions:
            raise invalid(
                "tool_choice.function.name",
                f"tool_choice.function.name={name!r} is not among the tools {sorted(functions)}",
            )
        index, parameters = functions[name]
        field = f"tools[{index}].function.parameters"
        constraint = check_compiles(Constraint("json", json.dumps(parameters), field))
    elif mode == "required":
        for index, parameters in functions.values():  # each, so an error names its tool
            check_compiles(
                Constraint("json", json.dumps(parameters), f"tools[{index}].function.parameters")
            )
        schemas = {name: parameters for name, (_, parameters) in functions.items()}
        try:
            schema = required_schema(schemas, parallel=parallel)
        except ValueError as error:
            raise invalid(
                "tools", f"tools cannot be combined into one call schema: {error}"
            ) from None
        constraint = check_compiles(Constraint("json", json.dumps(schema), "tools"))
    return ToolCalling(tuple(tools), mode, name, constraint)
