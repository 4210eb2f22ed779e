"""The engine core's session transport: one TCP connection per front end, carrying
length-prefixed frames, each one :mod:`specray.protocol` message (``FrontendBatch`` in,
``DeltaBatch`` out; msgpack with a version field, never pickle).

Not gRPC: a front end's messages are already typed and encoded, so a stream call adds only its
per-message work, which lands on the two busiest loops of the system, the engine core's and an
ingress's, once per submission and once per round (docs/design.md, "Front-end sessions";
docs/bench/history.md). Here a frame is one ``write`` on the sender's loop and one read on the
receiver's, with no thread between the socket and either loop.

A frame is a 4-byte big-endian length, then that many bytes, at most :data:`MAX_FRAME_BYTES`
(the same limit as every gRPC message of the project). A larger length ends the connection:
it is a peer speaking something else, not a message to buffer.
"""

from __future__ import annotations

import asyncio
import socket
import struct

from specray.protocol import ProtocolError
from specray.rpc.messages import MAX_MESSAGE_BYTES

MAX_FRAME_BYTES = MAX_MESSAGE_BYTES
_HEADER = struct.Struct("!I")
# A front end that stops reading its deltas is cut off once this much waits to be sent to it,
# rather than growing the engine core's memory without bound.
MAX_UNSENT_BYTES = 2 * MAX_FRAME_BYTES


def frame(payload: bytes) -> bytes:
    """``payload`` as one frame."""
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"a session message of {len(payload)} bytes is over {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(payload)) + payload


def _length(header: bytes) -> int:
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"a session frame of {length} bytes is over {MAX_FRAME_BYTES}")
    return length


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's payload; None when the peer closed between frames."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as error:
        if error.partial:
            raise ConnectionError("the session ended inside a frame header") from None
        return None
    try:
        return await reader.readexactly(_length(header))
    except asyncio.IncompleteReadError:
        raise ConnectionError("the session ended inside a frame") from None


def read_frame_blocking(sock: socket.socket) -> bytes | None:
    """:func:`read_frame` for a blocking socket (the driver's reader thread)."""
    header = _receive(sock, _HEADER.size)
    if header is None:
        return None
    payload = _receive(sock, _length(header))
    if payload is None:
        raise ConnectionError("the session ended inside a frame")
    return payload


def _receive(sock: socket.socket, size: int) -> bytes | None:
    """Exactly ``size`` bytes; None if the peer closed before the first."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        count = sock.recv_into(view[got:])
        if count == 0:
            if got:
                raise ConnectionError("the session ended inside a frame header")
            return None
        got += count
    return bytes(buffer)


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"an engine core address must be host:port, got {address!r}")
    return host, int(port)
