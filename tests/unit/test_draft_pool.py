"""The engine core's draft pool: one message per worker per turn of the loop, verdicts riding
with the next command, replies resolving their command's calls, a lost stream failing them."""

from __future__ import annotations

import asyncio

import pytest

from specray.engine_core.draft_streams import DraftWorkerLost, StreamDraftPool
from specray.protocol import (
    DraftCommand,
    DraftItem,
    DraftReply,
    PrefillReport,
    ProposeCall,
    ProposeReport,
    decode,
    encode,
)
from specray.v1 import speculation_pb2 as pb


def _item(request_id: str, step: int, k: int) -> DraftItem:
    return DraftItem(request_id, step, k, 0, ())


def _run(main):
    return asyncio.run(main())


def test_one_message_per_turn_with_the_staged_verdicts():
    async def main():
        pool, sent = StreamDraftPool(), []
        worker = pool.attach("w0", sent.append)
        assert pool.attach("w0", sent.append) == worker, "a known id keeps its index"
        pool.bind(asyncio.get_running_loop())
        pool.stage_verdict(worker, pb.Verdict(request_id="a", step=1, token_ids=[3, 4]))
        release = pool.release(worker, ["gone"])
        prefill = pool.prefill(worker, [_item("b", 1, 0)])
        propose = pool.propose(worker, ProposeCall((_item("a", 2, 3),), draft_ahead=True))
        await asyncio.sleep(0)  # the turn ends: one flush
        assert release.done() and not propose.done()
        (message,) = sent
        assert [v.request_id for v in message.verdicts] == ["a"]
        command = decode(message.command, DraftCommand)
        assert command.release == ("gone",) and command.prefill[0].request_id == "b"
        assert command.propose.items[0].k == 3
        # A second propose in the same turn cannot share the command: it gets its own.
        pool.propose(worker, ProposeCall((_item("c", 1, 2),), draft_ahead=False))
        pool.propose(worker, ProposeCall((_item("d", 1, 2),), draft_ahead=False))
        await asyncio.sleep(0)
        assert len(sent) == 3 and not sent[2].verdicts
        reports = DraftReply(command.seq, PrefillReport(1, 0.5), ProposeReport(1, 10, 0.25, 3))
        pool.on_message(worker, [encode(reports)])
        assert await prefill == PrefillReport(1, 0.5)
        assert (await propose).steps == 3
        assert pool.counters.messages_sent == 3 and pool.counters.commands_sent == 3

    _run(main)


def test_verdicts_alone_when_no_command_follows():
    async def main():
        pool, sent = StreamDraftPool(), []
        worker = pool.attach("w0", sent.append)
        pool.bind(asyncio.get_running_loop())
        pool.stage_verdict(worker, pb.Verdict(request_id="a", step=1))
        pool.schedule_flush()
        await asyncio.sleep(0)
        assert len(sent) == 1 and not sent[0].command and pool.counters.verdict_messages == 1

    _run(main)


def test_a_lost_stream_fails_its_calls_and_tells_the_coordinator():
    async def main():
        pool, lost = StreamDraftPool(), []
        worker = pool.attach("w0", lambda message: None)
        pool.bind(asyncio.get_running_loop(), lambda index, error: lost.append(index))
        propose = pool.propose(worker, ProposeCall((_item("a", 1, 2),), draft_ahead=False))
        await asyncio.sleep(0)
        pool.detach(worker)
        with pytest.raises(DraftWorkerLost):
            await propose
        assert lost == [worker] and not pool.available(worker)
        # Calls to a worker that is gone fail at once; a release has nothing to wait for.
        with pytest.raises(DraftWorkerLost):
            await pool.propose(worker, ProposeCall((_item("a", 2, 2),), draft_ahead=False))
        await pool.release(worker, ["a"])
        # It comes back under the same id: the same index, available again.
        assert pool.attach("w0", lambda message: None) == worker and pool.available(worker)

    _run(main)


def test_an_error_reply_fails_the_command():
    async def main():
        pool, sent = StreamDraftPool(), []
        worker = pool.attach("w0", sent.append)
        pool.bind(asyncio.get_running_loop())
        propose = pool.propose(worker, ProposeCall((_item("a", 1, 2),), draft_ahead=False))
        await asyncio.sleep(0)
        seq = decode(sent[0].command, DraftCommand).seq
        pool.on_message(worker, [encode(DraftReply(seq, error="ValueError: no state for a"))])
        with pytest.raises(RuntimeError, match="no state for a"):
            await propose

    _run(main)
