"""The target's gRPC service: one long-lived bidirectional stream per draft worker."""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from concurrent import futures

import grpc

from specray.rpc.inbox import BlockInbox
from specray.rpc.messages import InvalidMessageError, check_block, grpc_options
from specray.v1 import speculation_pb2 as pb
from specray.v1 import speculation_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_CLOSED = object()


class VerifierServicer(pb_grpc.VerifierServicer):
    """Each draft worker's stream: its first message names it to the ``pool``
    (:class:`specray.engine_core.draft_streams.StreamDraftPool`), blocks go to the ``inbox`` once
    validated, replies to the pool; what the pool sends goes down the same stream."""

    def __init__(self, inbox: BlockInbox, vocab_size: int, pool):
        self.inbox = inbox
        self.vocab_size = vocab_size
        self.pool = pool
        self._logged_invalid = False

    def Exchange(self, request_iterator, context):
        downs: queue.Queue = queue.Queue()
        try:
            hello = next(request_iterator)
        except (StopIteration, grpc.RpcError):
            return
        worker = self.pool.attach(hello.worker_id or uuid.uuid4().hex, downs.put)

        def read() -> None:
            try:
                for message in request_iterator:
                    self.receive(worker, message)
            except grpc.RpcError:
                pass  # the draft went away; its pending blocks simply never arrive
            finally:
                self.pool.detach(worker)
                downs.put(_CLOSED)

        threading.Thread(target=read, daemon=True).start()
        while True:
            message = downs.get()
            if message is _CLOSED:
                return
            yield message

    def receive(self, worker: int, message: pb.DraftUp) -> None:
        """One message of a draft worker (its stream, or a colocated draft's link): the blocks
        to the inbox once checked, the replies to the pool."""

        def stage(verdict: pb.Verdict) -> None:
            self.pool.stage_verdict(worker, verdict)

        for block in message.blocks:
            self._take_block(block, stage)
        self.pool.on_message(worker, message.replies)

    def _take_block(self, message: pb.DraftBlock, stage) -> None:
        try:
            block = check_block(message, self.vocab_size)
        except Exception as error:
            # Per block: a bug in validation must not end the draft's stream (the reader
            # thread), only drop this one block.
            if not isinstance(error, InvalidMessageError):
                log.exception("unexpected error validating a draft block")
            elif not self._logged_invalid:  # log once; the counter keeps the rest
                log.warning("dropping invalid draft block: %s", error)
                self._logged_invalid = True
            self.inbox.put_invalid(message.request_id, message.step, str(error))
            return
        self.inbox.put(block, stage)

    def Health(self, request, context):
        return pb.HealthResponse(status="SERVING", role="target", vocab_size=self.vocab_size)


def start_server(servicer: VerifierServicer, host: str = "127.0.0.1", port: int = 0):
    """Serve on ``host:port`` (0 = any free port); returns (server, bound address)."""
    # A thread per stream (draft workers) plus unary calls.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64), options=grpc_options())
    pb_grpc.add_VerifierServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, f"{host}:{bound}"
