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
import time

from specray.errors import UnavailableError
from specray.protocol import ProtocolError
from specray.rpc.messages import MAX_MESSAGE_BYTES

MAX_FRAME_BYTES = MAX_MESSAGE_BYTES
_HEADER = struct.Struct("!I")
# A front end that stops reading its deltas is cut off once this much waits to be sent to it,
# rather than growing the engine core's memory without bound.
MAX_UNSENT_BYTES = 2 * MAX_FRAME_BYTES
CONNECT_RETRY_S = 0.1  # between attempts to reach an engine core that is starting up


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
                raise ConnectionError("the session ended inside a frame")
            return None
        got += count
    return bytes(buffer)


def connect_blocking(address: str, timeout_s: float) -> socket.socket:
    """A connection to the engine core at ``address`` for a blocking client, retried for up
    to ``timeout_s`` (one starting up); UnavailableError if none answers by then."""
    host, port = split_address(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection(
                (host, port), timeout=max(deadline - time.monotonic(), 0.01)
            )
            break
        except OSError as error:
            if time.monotonic() >= deadline:
                raise _unanswered(address, error) from None
            time.sleep(CONNECT_RETRY_S)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a frame goes when written
    return sock


async def connect(
    address: str, timeout_s: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """:func:`connect_blocking` for asyncio (asyncio's TCP streams set TCP_NODELAY)."""
    loop = asyncio.get_running_loop()
    host, port = split_address(address)
    deadline = loop.time() + timeout_s
    while True:
        try:
            return await asyncio.wait_for(
                asyncio.open_connection(host, port), max(deadline - loop.time(), 0.01)
            )
        except (TimeoutError, OSError) as error:
            if loop.time() >= deadline:
                raise _unanswered(address, error) from None
            await asyncio.sleep(CONNECT_RETRY_S)


def _unanswered(address: str, error: BaseException) -> UnavailableError:
    return UnavailableError(f"no engine core answers at {address}: {error or 'timed out'}")


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"an engine core address must be host:port, got {address!r}")
    return host, int(port)
