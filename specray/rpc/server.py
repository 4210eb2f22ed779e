"""The target's gRPC service: one long-lived bidirectional stream per draft worker."""

from __future__ import annotations

import logging
import queue
import threading
from concurrent import futures

import grpc

from specray.rpc.inbox import BlockInbox
from specray.rpc.messages import InvalidMessageError, check_block, grpc_options
from specray.v1 import speculation_pb2 as pb
from specray.v1 import speculation_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_CLOSED = object()


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, inbox: BlockInbox, vocab_size: int):
        self.inbox = inbox
        self.vocab_size = vocab_size
        self._logged_invalid = False

    def Exchange(self, request_iterator, context):
        verdicts: queue.Queue = queue.Queue()

        def read_blocks() -> None:
            try:
                for message in request_iterator:
                    try:
                        block = check_block(message, self.vocab_size)
                    except Exception as error:
                        # Per message: a bug in validation must not end the draft's stream
                        # (the reader thread), only drop this one block.
                        if not isinstance(error, InvalidMessageError):
                            log.exception("unexpected error validating a draft block")
                        elif not self._logged_invalid:  # log once; the counter keeps the rest
                            log.warning("dropping invalid draft block: %s", error)
                            self._logged_invalid = True
                        self.inbox.put_invalid(message.request_id, message.step, str(error))
                        continue
                    self.inbox.put(block, verdicts.put)
            except grpc.RpcError:
                pass  # the draft went away; its pending blocks simply never arrive
            finally:
                verdicts.put(_CLOSED)

        threading.Thread(target=read_blocks, daemon=True).start()
        while True:
            verdict = verdicts.get()
            if verdict is _CLOSED:
                return
            yield verdict

    def Health(self, request, context):
        return pb.HealthResponse(status="SERVING", role="target", vocab_size=self.vocab_size)


def start_server(servicer: VerifierServicer, host: str = "127.0.0.1", port: int = 0):
    """Serve on ``host:port`` (0 = any free port); returns (server, bound address)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=grpc_options())
    pb_grpc.add_VerifierServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, f"{host}:{bound}"
