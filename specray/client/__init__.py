"""The specray client library: grpc, protobuf and the generated stubs only (no torch).

``Client`` (blocking) and ``AsyncClient`` (asyncio) share their methods: ``generate``,
``stream``, ``model_info``, ``health``, ``abort``. Every call failure is a
:class:`SpecrayClientError` carrying the gRPC status code and the server's message.
"""

from specray.client.aio import AsyncClient
from specray.client.config import ClientConfig
from specray.client.errors import SpecrayClientError
from specray.client.requests import StructuredOutputs
from specray.client.results import Chunk, Completion, ModelInfo, TokenLogprob
from specray.client.retry import RetryPolicy
from specray.client.sync import Client

__all__ = [
    "AsyncClient",
    "Chunk",
    "Client",
    "ClientConfig",
    "Completion",
    "ModelInfo",
    "RetryPolicy",
    "SpecrayClientError",
    "StructuredOutputs",
    "TokenLogprob",
]
