"""DraftWorker: a Ray actor that drafts blocks for many requests and streams them, with the
exact encoded q they were sampled from, straight to the target group's rank 0 over gRPC.

q takes one hop (draft -> target); the caller only tells the worker which requests to draft.
The worker keeps one long-lived bidirectional stream and reopens it if it breaks.
"""

from __future__ import annotations

import logging
import queue
import threading

import grpc

from specray.core import RequestState
from specray.drafters import DraftRequest, make_drafter
from specray.models.loading import LoadedModel, load_tokenizer, resolve_model_dir
from specray.rpc.messages import block_to_pb, grpc_options
from specray.sampling import DraftProbsEncoding
from specray.v1 import speculation_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class DraftWorker:
    def __init__(
        self,
        target: str,
        draft: str,
        draft_probs_encoding: str = "fp32",
        num_threads: int = 1,
    ):
        import torch

        torch.set_num_threads(num_threads)
        target_dir = resolve_model_dir(target, param="target")
        tokenizer = load_tokenizer(target_dir)
        # The drafter needs the target's files and tokenizer, not its weights.
        target_ref = LoadedModel(model=None, tokenizer=tokenizer, path=target_dir)
        config_vocab = _vocab_size(target_dir)
        self.encoding = DraftProbsEncoding.parse(draft_probs_encoding)
        self.drafter = make_drafter(
            draft, target_ref, config_vocab, self.encoding, keep_encoded=True
        )
        self.vocab_size = config_vocab
        self.requests: dict[str, RequestState] = {}
        self._target_address: str | None = None
        self._outbox: queue.Queue | None = None
        self.verdicts_received = 0
        self.bytes_sent = 0

    # ---- stream to the target ----------------------------------------------------------
    def connect(self, target_address: str) -> None:
        self._target_address = target_address
        self._open_stream()

    def _open_stream(self) -> None:
        channel = grpc.insecure_channel(self._target_address, options=grpc_options())
        outbox: queue.Queue = queue.Queue()
        responses = pb_grpc.VerifierStub(channel).Exchange(iter(outbox.get, None))

        def read_verdicts() -> None:
            try:
                for _verdict in responses:
                    self.verdicts_received += 1
            except grpc.RpcError as error:
                log.warning("draft stream to %s closed: %s", self._target_address, error.code())
            finally:
                if self._outbox is outbox:
                    self._outbox = None  # reopened on the next propose

        threading.Thread(target=read_verdicts, daemon=True).start()
        self._outbox = outbox

    # ---- drafting ----------------------------------------------------------------------
    def propose(self, round_spec: list[dict]) -> dict:
        """Draft for each request and stream the blocks to the target.

        Each item: ``request_id``, ``step``, ``output_token_ids`` (committed so far), ``k``,
        and on first sight ``prompt_token_ids``, ``params``, ``seed``.
        """
        if self._outbox is None:
            self._open_stream()
        asks = []
        for item in round_spec:
            state = self.requests.get(item["request_id"])
            if state is None:
                state = RequestState.from_spec(item, self.vocab_size, frozenset())
                self.requests[state.request_id] = state
            state.output_token_ids = list(item["output_token_ids"])
            asks.append(
                DraftRequest(
                    state.request_id,
                    state.prompt_token_ids,
                    state.output_token_ids,
                    state.pipeline,
                    state.random,
                    item["k"],
                )
            )
        sent_bytes = 0
        for item, ask, block in zip(round_spec, asks, self.drafter.propose(asks), strict=True):
            message = block_to_pb(
                ask.request_id,
                item["step"],
                len(ask.output_token_ids),
                block.token_ids,
                block.encoded,
            )
            sent_bytes += message.ByteSize()
            self._outbox.put(message)
        self.bytes_sent += sent_bytes
        return {"num_requests": len(asks), "bytes": sent_bytes}

    def release(self, request_ids: list[str]) -> None:
        self.drafter.release(request_ids)
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def stats(self) -> dict:
        return {"verdicts_received": self.verdicts_received, "bytes_sent": self.bytes_sent}


def _vocab_size(model_dir) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_dir, local_files_only=True).vocab_size)
