"""Where and how the client connects: target, TLS / mTLS, bearer token, retries, sizes."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from specray.client.retry import RetryPolicy

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # as the server's default
USER_AGENT = "specray-client/0.1"

PemSource = str | os.PathLike | bytes  # a file path, or the PEM bytes themselves
Metadata = Sequence[tuple[str, str]] | Mapping[str, str]


def read_pem(name: str, source: PemSource) -> bytes:
    """PEM bytes from a path or the bytes themselves; errors name ``name`` and never echo
    the content (it may be a private key)."""
    if isinstance(source, bytes):
        data = source
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"{name} must be a PEM file or PEM bytes; no file at {str(path)!r}")
        data = path.read_bytes()
    else:
        raise ValueError(f"{name} must be a path or PEM bytes, got {type(source).__name__}")
    if b"-----BEGIN " not in data:
        raise ValueError(f"{name} is not PEM (no '-----BEGIN' line in {len(data)} bytes)")
    return data


def check_token(name: str, token) -> None:
    if not isinstance(token, str) or not token or any(c.isspace() for c in token):
        raise ValueError(f"{name} must be a non-empty string without whitespace")


@dataclass(frozen=True)
class ClientConfig:
    """``tls`` None: TLS exactly when a TLS option is given; True with no ``root_certificates``
    uses the system's trusted roots. A ``token`` over plaintext is only for loopback or a
    trusted network."""

    target: str  # "host:port" (or any gRPC target URI, e.g. "dns:///host:port")
    token: str | None = field(default=None, repr=False)  # sent as "authorization: Bearer ..."
    tls: bool | None = None
    root_certificates: PemSource | None = None  # CA to trust (PEM); None: the system's
    client_cert: PemSource | None = None  # mTLS: this client's certificate chain (PEM)
    client_key: PemSource | None = field(default=None, repr=False)  # and its key (PEM)
    server_name: str | None = None  # expected name in the server's certificate
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target or " " in self.target:
            raise ValueError(f"target must be 'host:port', got {self.target!r}")
        if self.token is not None:
            check_token("token", self.token)
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key must be given together (mTLS)")
        for name in ("root_certificates", "client_cert", "client_key"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, read_pem(name, getattr(self, name)))
        if self.server_name is not None and (
            not isinstance(self.server_name, str) or not self.server_name
        ):
            raise ValueError(f"server_name must be a non-empty string, got {self.server_name!r}")
        wants_tls = any(
            getattr(self, name) is not None
            for name in ("root_certificates", "client_cert", "server_name")
        )
        if self.tls is None:
            object.__setattr__(self, "tls", wants_tls)
        elif not isinstance(self.tls, bool):
            raise ValueError(f"tls must be true, false or None, got {self.tls!r}")
        elif wants_tls and not self.tls:
            raise ValueError("tls=False contradicts root_certificates / client_cert / server_name")
        if not isinstance(self.retry, RetryPolicy):
            raise ValueError(f"retry must be a RetryPolicy, got {self.retry!r}")
        size = self.max_message_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 1024:
            raise ValueError(f"max_message_bytes must be an integer >= 1024, got {size!r}")

    def channel_options(self) -> list[tuple[str, object]]:
        options = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.primary_user_agent", USER_AGENT),
        ]
        if self.server_name is not None:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return options

    def credentials(self) -> grpc.ChannelCredentials | None:
        """None: plaintext."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.client_key,
            certificate_chain=self.client_cert,
        )

    def call_metadata(self, metadata: Metadata | None) -> tuple[tuple[str, str], ...] | None:
        """The caller's metadata plus the bearer token."""
        pairs = list(metadata.items() if isinstance(metadata, Mapping) else metadata or ())
        if self.token is not None:
            pairs.append(("authorization", f"Bearer {self.token}"))
        return tuple(pairs) or None


def config_from_options(target: str, max_retries: int | None, **options) -> ClientConfig:
    """The clients' keyword arguments (None: the default); ``max_retries`` overrides the retry
    policy's."""
    options = {name: value for name, value in options.items() if value is not None}
    if max_retries is not None:
        options["retry"] = replace(options.get("retry", RetryPolicy()), max_retries=max_retries)
    return ClientConfig(target, **options)
