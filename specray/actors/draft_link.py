"""A draft worker's one stream to the engine core on the target group's rank 0.

Per round, one message each way: the engine core sends the verdicts of this worker's requests
with the next :class:`~specray.protocol.DraftCommand`; the worker answers with that command's
blocks (all of them in one message) and its report on the previous command
(:class:`~specray.protocol.DraftReply`). Reports are held back while another command waits,
so they ride with the next blocks; with nothing waiting they go alone.

Commands run one at a time on the link's own thread, in arrival order. When a command arrives
the worker's draft-ahead yields (``on_arrival``), exactly as for a call made any other way.

:class:`DraftLink` carries the messages over gRPC (a draft worker in its own process);
:class:`LocalDraftLink` hands the same messages over in memory to the engine core of the
process it lives in (a draft colocated with the target: ``draft_placement="colocated"``).
"""

from __future__ import annotations

import abc
import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import Callable

import grpc

from specray.actors.ray_calls import mark_round_path_thread
from specray.protocol import DraftCommand, DraftReply, ProtocolError, decode, encode
from specray.rpc.messages import grpc_options
from specray.v1 import speculation_pb2 as pb
from specray.v1 import speculation_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class _Link(abc.ABC):
    """What both transports share: the command thread, the held-back reports, receiving a
    ``DraftDown``. ``take_verdict(verdict)`` runs on the receiving thread for every verdict;
    ``run_command(command) -> DraftReply | None`` on the link's thread for every command;
    ``on_arrival()`` when a command arrives (a draft-ahead in progress must yield).
    Subclasses open the transport (``_open``) and send one ``DraftUp`` (``_deliver``)."""

    def __init__(
        self,
        *,
        take_verdict: Callable[[pb.Verdict], None],
        run_command: Callable[[DraftCommand], DraftReply | None],
        on_arrival: Callable[[], None],
        worker_id: str | None = None,
    ):
        self.worker_id = worker_id or uuid.uuid4().hex
        self._take_verdict, self._run_command = take_verdict, run_command
        self._on_arrival = on_arrival
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # the transport and the held-back replies
        self._held_replies: list[DraftReply] = []
        self.messages_sent = 0
        self.messages_received = 0
        self.commands_run = 0
        self._open()
        self._server = threading.Thread(target=self._serve, name="draft-commands", daemon=True)
        self._server.start()

    @property
    def commands_waiting(self) -> int:
        return self._commands.qsize()

    @abc.abstractmethod
    def _open(self) -> None:
        """Open the transport (also called again by a send after it broke)."""

    @abc.abstractmethod
    def _deliver(self, message: pb.DraftUp) -> None:
        """Send one message (under ``_lock``)."""

    def _receive(self, message: pb.DraftDown) -> None:
        """One message from the engine core: its verdicts, then its command."""
        self.messages_received += 1
        for verdict in message.verdicts:
            self._take_verdict(verdict)
        if message.command:
            self._arrive(message.command)

    def _arrive(self, payload: bytes) -> None:
        try:
            command = decode(payload, DraftCommand)
        except ProtocolError as error:  # a bug on the other side: say so, keep the stream
            log.error("dropping an undecodable draft command: %s", error)
            return
        self._commands.put(command)
        self._on_arrival()

    def _serve(self) -> None:
        mark_round_path_thread()
        while True:
            command = self._commands.get()
            if command is None:  # closed
                return
            reply = self._run_command(command)
            self.commands_run += 1
            with self._lock:
                if reply is not None:
                    self._held_replies.append(reply)
                if self._held_replies and self._commands.empty():
                    self._send_locked(pb.DraftUp())  # idle: the reports go alone

    def send_blocks(self, blocks: list[pb.DraftBlock]) -> int:
        """One message with every block of a command (and the report held back, if any);
        returns its size in bytes."""
        message = pb.DraftUp(blocks=blocks)
        with self._lock:
            return self._send_locked(message)

    def _send_locked(self, message: pb.DraftUp) -> int:
        message.replies.extend(encode(reply) for reply in self._held_replies)
        self._held_replies.clear()
        self._deliver(message)
        self.messages_sent += 1
        return message.ByteSize()

    def send_later(self, delay_s: float, blocks: list[pb.DraftBlock]) -> None:
        """Blocks delayed by an injected link fault (the chaos suite)."""
        threading.Timer(delay_s, self.send_blocks, (blocks,)).start()

    def _drop_commands(self) -> None:
        """Take no more commands; those not started are dropped."""
        with contextlib.suppress(queue.Empty):
            while True:
                self._commands.get_nowait()
        self._commands.put(None)

    def _join(self, timeout_s: float | None) -> None:
        """Wait up to ``timeout_s`` for a command under way (None: do not wait)."""
        if timeout_s is not None and threading.current_thread() is not self._server:
            self._server.join(timeout_s)


class DraftLink(_Link):
    """The stream over gRPC to the engine core at ``address``."""

    def __init__(self, address: str, **callbacks):
        self.address = address
        self._outbox: queue.Queue | None = None
        super().__init__(**callbacks)

    @property
    def open(self) -> bool:
        return self._outbox is not None

    def _open(self) -> None:
        channel = grpc.insecure_channel(self.address, options=grpc_options())
        outbox: queue.Queue = queue.Queue()
        outbox.put(pb.DraftUp(worker_id=self.worker_id))  # who is speaking, first
        responses = pb_grpc.VerifierStub(channel).Exchange(iter(outbox.get, None))

        def read() -> None:
            try:
                for message in responses:
                    self._receive(message)
            except grpc.RpcError as error:
                log.warning("draft stream to %s closed: %s", self.address, error.code())
            finally:
                with self._lock:
                    if self._outbox is outbox:
                        self._outbox = None  # reopened by the next send

        with self._lock:
            self._outbox = outbox
        threading.Thread(target=read, name="draft-verdicts", daemon=True).start()

    def _deliver(self, message: pb.DraftUp) -> None:
        if self._outbox is None:
            self._open_locked()
        self._outbox.put(message)

    def _open_locked(self) -> None:
        self._lock.release()
        try:
            self._open()
        finally:
            self._lock.acquire()

    def close(self, timeout_s: float | None = None) -> None:
        """Stop taking commands (those not started are dropped) and close the stream;
        ``timeout_s``: wait that long for a command under way to end."""
        self._drop_commands()
        with self._lock:
            if self._outbox is not None:
                self._outbox.put(None)
                self._outbox = None
        self._join(timeout_s)


class LocalDraftLink(_Link):
    """The engine core of this process (``verifier``: its
    :class:`~specray.rpc.server.VerifierServicer`), in memory: the stream's messages handed over
    as objects, no bytes on a socket. As over gRPC, what the engine core sends is read on a
    thread of the link's own (the engine core's loop never runs draft code), and blocks are
    checked like any draft's before the target takes them."""

    def __init__(self, verifier, **callbacks):
        self._verifier = verifier
        self._downs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: int | None = None
        super().__init__(**callbacks)

    @property
    def open(self) -> bool:
        return self._worker is not None

    def _open(self) -> None:
        self._worker = self._verifier.pool.attach(self.worker_id, self._downs.put)
        threading.Thread(target=self._read, name="draft-verdicts", daemon=True).start()

    def _read(self) -> None:
        while (message := self._downs.get()) is not None:
            self._receive(message)

    def _deliver(self, message: pb.DraftUp) -> None:
        if self._worker is not None:  # closed: nothing listens any more
            self._verifier.receive(self._worker, message)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop taking commands and leave the engine core's pool (its calls in flight fail)."""
        self._drop_commands()
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            self._verifier.pool.detach(worker)
        self._downs.put(None)
        self._join(timeout_s)
