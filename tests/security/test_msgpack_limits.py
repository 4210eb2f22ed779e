"""msgpack is decoded with explicit limits everywhere.

Static: every ``msgpack.unpackb`` / ``msgpack.Unpacker`` call under ``specray/`` names every
length limit, ``raw`` and ``strict_map_key`` (no implicit defaults), and no alias
(``msgpack.loads``, ``from msgpack import unpackb``) slips past; the scanner's negative control
flags each omission.

Per site (one today: a TP follower decoding its leader's command in
``specray.actors.tp_group.follow``): the follower loop itself is fed payloads one past each
limit (string, array, map), binary and extension values, a non-string map key and a non-map;
each is refused with ValueError before anything reaches the model runner. A command at the
limits still runs. Request ids, which become sequence ids in those commands, are bounded where
requests enter, below the string limit.
"""

from __future__ import annotations

import ast
from pathlib import Path

import msgpack
import pytest

from specray.actors import tp_group
from specray.actors.tp_group import (
    MAX_COMMAND_ARRAY_LEN,
    MAX_COMMAND_MAP_LEN,
    MAX_COMMAND_STR_CHARS,
)
from specray.errors import InvalidRequestError
from specray.rpc.messages import MAX_REQUEST_ID_CHARS
from specray.serve.protocol import GenerateRequest

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = {"raw", "strict_map_key", "max_str_len", "max_bin_len", "max_array_len"}
REQUIRED |= {"max_map_len", "max_ext_len"}
DECODERS = {"unpackb", "Unpacker", "unpack", "loads", "load"}


# ---- static: every call site ---------------------------------------------------------------------
def unbounded_decodes(source: str) -> list[str]:
    """msgpack decode calls in ``source`` lacking an explicit keyword of :data:`REQUIRED`."""
    findings = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "msgpack":
            names = [a.name for a in node.names if a.name in DECODERS]
            if names:
                findings.append(f"line {node.lineno}: from msgpack import {', '.join(names)}")
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if not (isinstance(owner, ast.Name) and owner.id == "msgpack"):
            continue
        if node.func.attr in ("unpack", "loads", "load"):
            findings.append(f"line {node.lineno}: msgpack.{node.func.attr}() (use unpackb)")
        elif node.func.attr in ("unpackb", "Unpacker"):
            given = {keyword.arg for keyword in node.keywords}
            required = REQUIRED | ({"max_buffer_size"} if node.func.attr == "Unpacker" else set())
            missing = sorted(required - given)
            if missing:
                findings.append(f"line {node.lineno}: msgpack.{node.func.attr}() without {missing}")
    return sorted(findings, key=lambda finding: int(finding.split()[1].rstrip(":")))


def test_scanner_negative_control_flags_unbounded_decodes():
    bounded = ", ".join(f"{name}=1" for name in sorted(REQUIRED))
    snippet = "\n".join(
        [
            "msgpack.unpackb(data)",
            "msgpack.unpackb(data, max_str_len=10)",
            f"msgpack.Unpacker(stream, {bounded})",  # no max_buffer_size
            "msgpack.loads(data)",
            "from msgpack import unpackb",
            f"msgpack.unpackb(data, {bounded})",  # complete: not flagged
            f"msgpack.Unpacker(stream, max_buffer_size=1, {bounded})",
        ]
    )
    assert [f.split(":")[0] for f in unbounded_decodes(snippet)] == [
        f"line {n}" for n in range(1, 6)
    ]


def test_every_msgpack_decode_in_specray_has_explicit_limits():
    findings, sites = [], 0
    for path in sorted((ROOT / "specray").rglob("*.py")):
        source = path.read_text()
        sites += source.count("msgpack.unpackb(") + source.count("msgpack.Unpacker(")
        findings += [f"{path.relative_to(ROOT)} {f}" for f in unbounded_decodes(source)]
    assert not findings, "\n".join(findings)
    assert sites >= 1, "the TP follower's decode is gone: update this module's site list"


# ---- per site: the TP follower ------------------------------------------------------------------
class RecordingRunner:
    """A model runner that only records what the follower asks of it."""

    def __init__(self):
        self.calls: list[tuple] = []

    def forward(self, feeds, num_logits):
        self.calls.append(("forward", feeds))

    def rollback(self, seq_id, num_tokens):
        self.calls.append(("rollback", seq_id, num_tokens))

    def remove(self, seq_ids):
        self.calls.append(("remove", seq_ids))


def _follow(monkeypatch, payloads: list[bytes]) -> tuple[int, RecordingRunner]:
    """Run the real follower loop on ``payloads`` as if broadcast by the leader."""
    queue = iter(payloads)
    monkeypatch.setattr(tp_group, "_broadcast_bytes", lambda payload, group=None: next(queue))
    runner = RecordingRunner()
    return tp_group.follow(runner), runner


STOP = msgpack.packb({"op": "stop", "ops": []})


def _forward(feeds, ops=()) -> bytes:
    return msgpack.packb({"op": "forward", "ops": list(ops), "feeds": feeds})


OVER_LIMIT = {
    "string one past the limit": lambda: _forward({"s" * (MAX_COMMAND_STR_CHARS + 1): [1]}),
    "array one past the limit": lambda: _forward({"s": [0] * (MAX_COMMAND_ARRAY_LEN + 1)}),
    "map one past the limit": lambda: _forward(
        {f"s{i}": [1] for i in range(MAX_COMMAND_MAP_LEN + 1)}
    ),
    "binary value": lambda: _forward({"s": [1]}, ops=[["remove", [b"raw-bytes"]]]),
    "extension value": lambda: _forward({"s": [1]}, ops=[msgpack.ExtType(5, b"x")]),
    "integer map key": lambda: msgpack.packb({"op": "forward", "ops": [], "feeds": {7: [1]}}),
    "not a map": lambda: msgpack.packb(["forward", [], {}]),
}


@pytest.mark.parametrize("label", OVER_LIMIT)
def test_the_follower_refuses_an_over_limit_command_before_running_it(monkeypatch, label):
    with pytest.raises(ValueError):
        _follow(monkeypatch, [OVER_LIMIT[label](), STOP])


def test_a_command_at_the_limits_runs(monkeypatch):
    at_limit = _forward(
        {"s" * MAX_COMMAND_STR_CHARS: [0] * MAX_COMMAND_ARRAY_LEN},
        ops=[["rollback", "s" * MAX_COMMAND_STR_CHARS, 2]],
    )
    many = _forward({f"s{i}": [1] for i in range(MAX_COMMAND_MAP_LEN)}, ops=[["remove", ["a"]]])
    forwards, runner = _follow(monkeypatch, [at_limit, many, STOP])
    assert forwards == 2
    assert [call[0] for call in runner.calls] == ["rollback", "forward", "remove", "forward"]
    assert len(runner.calls[1][1]["s" * MAX_COMMAND_STR_CHARS]) == MAX_COMMAND_ARRAY_LEN


# ---- what feeds that site: request ids ---------------------------------------------------------
def test_request_ids_are_bounded_below_the_command_string_limit(local_backend, loop_thread):
    assert MAX_REQUEST_ID_CHARS <= MAX_COMMAND_STR_CHARS

    async def first_event(request_id: str):
        events = local_backend.generate(
            GenerateRequest(prompt="hi", params={"max_tokens": 1}, request_id=request_id)
        )
        try:
            return await anext(events)
        finally:
            await events.aclose()

    with pytest.raises(InvalidRequestError) as caught:
        loop_thread.run(first_event("r" * (MAX_REQUEST_ID_CHARS + 1)))
    assert caught.value.param == "request_id"
    assert len(caught.value.message) < 200, "the message echoes the whole id"
    assert loop_thread.run(first_event("r" * MAX_REQUEST_ID_CHARS))["kind"] in ("delta", "final")
