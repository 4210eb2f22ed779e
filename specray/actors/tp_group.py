"""Lockstep driving of a tensor-parallel group: rank 0 leads, the other ranks follow.

Every rank owns a ModelRunner over its shard, and every rank must run the same forwards in the
same order (each forward makes two all-reduces per layer). Rank 0 wraps its runner in a
:class:`LeaderRunner` that broadcasts each forward as a small msgpack command (no pickle) before
running it; rollbacks and removals are local cache edits, so they are queued and ride along
with the next forward. Followers run :func:`follow` until told to stop. Followers compute no
logits: only rank 0 samples.

Commands travel on a gloo group of their own (:func:`command_group`: CPU tensors, whatever
backend the all-reduces use), with a finite timeout. While the group is idle the leader sends a
ping every ``HEARTBEAT_S``, so a follower that hears nothing for ``COMMAND_TIMEOUT_S`` knows
its leader is dead or hung: its loop fails, and the group is replaced as a unit.
"""

from __future__ import annotations

import datetime
import struct
import threading
import time
from collections.abc import Hashable, Mapping, Sequence

import msgpack
import torch
import torch.distributed as dist

from specray.models.runner import ModelRunner

MAX_COMMAND_BYTES = 64 * 1024 * 1024  # a forward command carries token ids only
# Explicit msgpack limits on a decoded command (docs/design.md section 6); a command over them is
# refused whole. Strings are op names and sequence ids (request ids, at most 128 characters).
MAX_COMMAND_STR_CHARS = 1024
MAX_COMMAND_ARRAY_LEN = 1 << 22  # token ids fed to one sequence, ops, removed ids
MAX_COMMAND_MAP_LEN = 1 << 16  # sequences in one forward


# One broadcast carries a command up to this size (its length in the first 8 bytes); a larger
# one (a long prompt's prefill) sends its rest in a second. Two collectives per forward cost
# 0.38 ms on gloo here, one of 4 KiB 0.19-0.27 ms (docs/bench/history.md).
HEADER_BYTES = 4096
_LENGTH = struct.Struct("<q")
HEARTBEAT_S = 1.0  # an idle leader pings this often ...
COMMAND_TIMEOUT_S = 15.0  # ... and a follower that heard nothing for this long fails
_PING = msgpack.packb({"op": "ping", "ops": []})


def command_group(timeout_s: float = COMMAND_TIMEOUT_S):
    """The gloo group the commands travel on; every rank of the default group calls it, in the
    same order, right after joining that group."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def _broadcast_bytes(payload: bytes | None, group=None) -> bytes:
    """Rank 0 sends ``payload`` over ``group`` (default: the world); every rank returns it."""
    first = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    if payload is not None:
        head = _LENGTH.pack(len(payload)) + payload[: HEADER_BYTES - _LENGTH.size]
        first[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    dist.broadcast(first, src=0, group=group)
    data = first.numpy().tobytes()
    (count,) = _LENGTH.unpack_from(data)
    if not 0 <= count <= MAX_COMMAND_BYTES:
        raise ValueError(f"TP command of {count} bytes exceeds {MAX_COMMAND_BYTES}")
    inline = data[_LENGTH.size : _LENGTH.size + count]
    rest = count - len(inline)
    if rest == 0:
        return inline
    if payload is None:
        buffer = torch.empty(rest, dtype=torch.uint8)
    else:
        buffer = torch.frombuffer(bytearray(payload[len(inline) :]), dtype=torch.uint8)
    dist.broadcast(buffer, src=0, group=group)
    return inline + buffer.numpy().tobytes()


def decode_command(payload: bytes) -> dict:
    """A leader's command from its msgpack bytes: no binary or extension types, string keys,
    every length bounded; ValueError (msgpack's) when the payload exceeds a limit."""
    if len(payload) > MAX_COMMAND_BYTES:
        raise ValueError(f"TP command of {len(payload)} bytes exceeds {MAX_COMMAND_BYTES}")
    command = msgpack.unpackb(
        payload,
        raw=False,
        use_list=True,
        strict_map_key=True,
        max_str_len=MAX_COMMAND_STR_CHARS,
        max_bin_len=0,
        max_ext_len=0,
        max_array_len=MAX_COMMAND_ARRAY_LEN,
        max_map_len=MAX_COMMAND_MAP_LEN,
    )
    if not isinstance(command, dict):
        raise ValueError(f"a TP command must be a map, got {type(command).__name__}")
    return command


def _apply_ops(runner: ModelRunner, ops: list) -> None:
    for op in ops:
        if op[0] == "rollback":
            runner.rollback(op[1], op[2])
        elif op[0] == "remove":
            runner.remove(op[1])
        else:
            raise ValueError(f"unknown TP op {op[0]!r}")


class LeaderRunner:
    """Rank 0's runner: the ModelRunner interface, mirrored on every follower. From its first
    command on, a thread pings the followers whenever no command went out for ``heartbeat_s``."""

    def __init__(self, runner: ModelRunner, group=None, heartbeat_s: float = HEARTBEAT_S):
        self.runner = runner
        self.model = runner.model
        self.vocab_size = runner.vocab_size
        self.device = runner.device
        self._ops: list = []  # local edits not yet sent to the followers
        self._group, self._heartbeat_s = group, heartbeat_s
        self._send_lock = threading.Lock()  # one broadcast at a time: forward or ping
        self._last_sent = time.monotonic()
        self._stopped = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def _send(self, payload: bytes) -> None:
        with self._send_lock:
            _broadcast_bytes(payload, self._group)
            self._last_sent = time.monotonic()
        if self._heartbeat is None and not self._stopped.is_set():
            # Started after the first command: the followers are listening by then.
            self._heartbeat = threading.Thread(target=self._ping, name="tp-heartbeat", daemon=True)
            self._heartbeat.start()

    def _ping(self) -> None:
        while not self._stopped.wait(self._heartbeat_s / 4):
            with self._send_lock:
                if self._stopped.is_set():
                    return
                if time.monotonic() - self._last_sent >= self._heartbeat_s:
                    _broadcast_bytes(_PING, self._group)
                    self._last_sent = time.monotonic()

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self.runner

    def length(self, seq_id: Hashable) -> int:
        return self.runner.length(seq_id)

    def forward(
        self,
        new_token_ids: Mapping[Hashable, Sequence[int]],
        num_logits: Mapping[Hashable, int],
        *,
        num_hidden: Mapping[Hashable, int] | None = None,
    ):
        """As ModelRunner.forward; ``num_hidden`` (target features) is rank 0's alone: the
        final-norm hidden state is whole after the last all-reduce, followers need none."""
        feeds = {seq_id: list(tokens) for seq_id, tokens in new_token_ids.items()}
        self._send(msgpack.packb({"op": "forward", "ops": self._ops, "feeds": feeds}))
        self._ops = []
        return self.runner.forward(feeds, num_logits, num_hidden=num_hidden)

    time_forward = ModelRunner.time_forward  # through forward(): the followers run it too

    def rollback(self, seq_id: Hashable, num_tokens: int) -> None:
        self.runner.rollback(seq_id, num_tokens)
        if num_tokens > 0:
            self._ops.append(("rollback", seq_id, num_tokens))

    def remove(self, seq_ids: Sequence[Hashable]) -> None:
        self.runner.remove(seq_ids)
        self._ops.append(("remove", list(seq_ids)))

    def stop_heartbeat(self) -> None:
        """No more pings (the followers then time out unless a command or stop follows)."""
        with self._send_lock:
            self._stopped.set()
        if self._heartbeat is not None:
            self._heartbeat.join()

    def stop(self) -> None:
        self.stop_heartbeat()
        _broadcast_bytes(msgpack.packb({"op": "stop", "ops": self._ops}), self._group)
        self._ops = []


def follow(runner: ModelRunner, group=None) -> int:
    """A follower's loop: mirror the leader's commands until it stops. Returns forwards run.
    Raises when no command or ping arrives within the group's timeout."""
    forwards = 0
    while True:
        command = decode_command(_broadcast_bytes(None, group))
        _apply_ops(runner, command["ops"])
        if command["op"] == "stop":
            return forwards
        if command["op"] == "ping":
            continue
        runner.forward(command["feeds"], {})
        forwards += 1
