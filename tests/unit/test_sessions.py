"""Front ends' sessions on the engine core (``engine_core/sessions.py`` over
``engine_core/session_wire.py``): a real coordinator over a simulated target, its session
server on loopback TCP, and a front end speaking frames to it. Messages are taken in the order
sent, however many arrive in one read; a front end that goes away takes its requests with it;
bytes that are not a session's end the session, not the engine core."""

from __future__ import annotations

import asyncio
import random
import struct

import pytest

from specray.engine_core.coordinator import Coordinator, CoordinatorConfig
from specray.engine_core.policy import DraftCost, VerifyCost
from specray.engine_core.session_wire import (
    MAX_FRAME_BYTES,
    frame,
    read_frame,
    split_address,
)
from specray.engine_core.sessions import SessionServer
from specray.protocol import DeltaBatch, FrontendBatch, ProtocolError, Submit, decode, encode
from specray.sampling import SamplingParams
from specray.sim import AcceptanceModel, LatencyModel
from specray.sim.workers import SimInbox, SimTargetBackend

pytestmark = pytest.mark.unit
VOCAB = 64
LATENCY = LatencyModel(
    verify=VerifyCost(fixed_s=0.002, per_request_s=0.0, per_token_s=0.0),
    draft_step=DraftCost(fixed_s=0.001, per_request_s=0.0),
    rtt_s=0.0,
    coordinator_overhead_s=0.0,
)


def _submit(request_id: str, max_tokens: int) -> bytes:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return encode(FrontendBatch(submits=(Submit(request_id, (5, 6, 7), params),)))


class _Engine:
    """A coordinator over a simulated target, and its session server on loopback."""

    async def __aenter__(self):
        rng = random.Random(0)
        self.target = SimTargetBackend(LATENCY, AcceptanceModel((0.5,)), SimInbox(), rng)
        config = CoordinatorConfig(num_speculative_tokens=0)
        self.coordinator = Coordinator(self.target, None, config, vocab_size=VOCAB)
        await self.coordinator.start()
        self.server = SessionServer(self.coordinator)
        self.address = await self.server.start("127.0.0.1")
        return self

    async def __aexit__(self, *exc):
        self.server.close_all()
        await self.coordinator.stop()

    async def connect(self):
        return await asyncio.open_connection(*split_address(self.address))


async def _ends(reader, wanted: int, timeout_s: float = 10.0) -> tuple[dict, dict]:
    """Read deltas until ``wanted`` requests ended: (request id -> tokens, -> how it ended)."""
    tokens, ends = {}, {}
    while len(ends) < wanted:
        payload = await asyncio.wait_for(read_frame(reader), timeout_s)
        assert payload is not None, "the engine core closed the session"
        for delta in decode(payload, DeltaBatch).deltas:
            tokens[delta.request_id] = tokens.get(delta.request_id, ()) + delta.token_ids
            if delta.finished is not None:
                ends[delta.request_id] = delta.finished.finish_reason
            elif delta.error is not None:
                ends[delta.request_id] = delta.error.type
    return tokens, ends


def test_messages_arriving_together_are_taken_in_the_order_sent():
    """Three frames in one write: ``a``'s abort behind its submission cancels it, ``b`` runs to
    its length. Taken in another order the abort would find nothing and ``a`` would run."""

    async def main():
        async with _Engine() as engine:
            reader, writer = await engine.connect()
            aborts = encode(FrontendBatch(aborts=("a",)))
            writer.write(frame(_submit("a", 6)) + frame(_submit("b", 4)) + frame(aborts))
            tokens, ends = await _ends(reader, 2)
            writer.close()
            return tokens, ends, await engine.target.held_requests()

    tokens, ends, held = asyncio.run(main())
    assert ends == {"a": "cancelled_error", "b": "length"}
    assert len(tokens["b"]) == 4 and not tokens.get("a")
    assert held == []


def test_a_front_end_going_away_takes_its_requests_with_it():
    """A long request, then the connection closed: it is aborted and the target freed, and
    the session is gone. Control: the same request with the front end staying runs to its
    length."""

    async def main(leave: bool):
        async with _Engine() as engine:
            reader, writer = await engine.connect()
            writer.write(frame(_submit("c", 40)))
            await writer.drain()
            if leave:
                await asyncio.sleep(0.05)  # admitted and running
                writer.close()
                await asyncio.sleep(0.2)
                running = engine.coordinator.num_running + engine.coordinator.num_waiting
                return running, await engine.target.held_requests(), len(engine.server.sessions)
            tokens, ends = await _ends(reader, 1)
            writer.close()
            return tokens, ends, await engine.target.held_requests()

    running, held, sessions = asyncio.run(main(leave=True))
    assert running == 0 and held == [] and sessions == 0
    tokens, ends, held = asyncio.run(main(leave=False))
    assert ends == {"c": "length"} and len(tokens["c"]) == 40 and held == []


@pytest.mark.parametrize(
    "garbage",
    [
        struct.pack("!I", MAX_FRAME_BYTES + 1),  # a length no session message has
        frame(b"\x93\x01\x02\x03"),  # a frame, but not a message of this protocol
    ],
    ids=["oversized", "not-a-message"],
)
def test_bytes_that_are_not_a_session_end_it_and_the_engine_core_stays_up(garbage):
    async def main():
        async with _Engine() as engine:
            reader, writer = await engine.connect()
            writer.write(garbage)
            closed = await asyncio.wait_for(read_frame(reader), 5.0)
            # Another front end is served as before.
            reader, writer = await engine.connect()
            writer.write(frame(_submit("d", 3)))
            _, ends = await _ends(reader, 1)
            writer.close()
            return closed, ends

    closed, ends = asyncio.run(main())
    assert closed is None and ends == {"d": "length"}


def test_frames_carry_their_limit_both_ways():
    with pytest.raises(ProtocolError, match="over"):
        frame(b"x" * (MAX_FRAME_BYTES + 1))

    async def read(data: bytes):
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader)

    assert asyncio.run(read(frame(b"abc"))) == b"abc"
    assert asyncio.run(read(b"")) is None  # closed between frames
    with pytest.raises(ConnectionError):
        asyncio.run(read(frame(b"abc")[:-1]))  # closed inside one
    with pytest.raises(ProtocolError):
        asyncio.run(read(struct.pack("!I", MAX_FRAME_BYTES + 1)))
    with pytest.raises(ValueError, match="host:port"):
        split_address("localhost")
