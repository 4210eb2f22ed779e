"""Structured-output specs as requests give them, checked without a grammar library (so
:class:`~specray.sampling.params.SamplingParams` can check them anywhere); compiling them is
:mod:`specray.sampling.grammar`'s."""

from __future__ import annotations

import json

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema or grammar's text at most


class GrammarError(ValueError):
    """A structured-output spec that is malformed or that the grammar library refuses."""


def check_spec(kind: str, spec: str) -> None:
    """The checks that need no grammar library (SamplingParams runs them, also in clients)."""
    if kind not in KINDS:
        raise GrammarError(f"structured output kind must be one of {list(KINDS)}, got {kind!r}")
    if not isinstance(spec, str):
        raise GrammarError(f"a {kind} structured output is given as text, got {type(spec)}")
    if len(spec) > MAX_SPEC_CHARS:
        raise GrammarError(f"a {kind} spec of {len(spec)} characters exceeds {MAX_SPEC_CHARS}")
    if kind in ("json", "choice"):
        try:
            value = json.loads(spec)
        except ValueError as error:
            raise GrammarError(f"the {kind} spec is not JSON: {error}") from None
        if kind == "json" and not isinstance(value, dict | bool):
            raise GrammarError(f"a JSON schema is an object, got {spec[:80]!r}")
        if kind == "choice" and (
            not isinstance(value, list)
            or not value
            or not all(isinstance(item, str) and item for item in value)
        ):
            raise GrammarError(
                f"choice must be a non-empty list of non-empty strings, got {value!r}"
            )
    elif kind in ("regex", "grammar") and not spec:
        raise GrammarError(f"the {kind} must not be empty")
