"""Protobuf messages of the draft <-> target contract, and their validation.

Every inbound message is validated before use (docs/design.md section 3): shapes, token ids in
range, k <= MAX_SPEC_LEN, q finite, non-negative and summing to 1 within a tolerance, and q > 0
at every drafted token. A block that fails raises :class:`InvalidMessageError`; the caller
drops it and runs that round target-only, so it never reaches the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specray.sampling import (
    MAX_SPEC_LEN,
    DraftProbsEncoding,
    EncodedDraftProbs,
    WireTensor,
    decode_draft_probs,
)
from specray.sampling.encoding import SparseDraftProbs, decode_sparse_draft_probs
from specray.v1 import speculation_pb2 as pb

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # explicit gRPC send/receive limit on both ends
MAX_REQUEST_ID_CHARS = 128
# fp16 keeps ~3 decimal digits: an honest q's row sums stay within this of 1 after encoding.
ROW_SUM_TOLERANCE = 1e-2
# The values dtype each encoding implies (sparse top<M> values are float32): decoding other
# bytes would be a different q than the draft sampled from.
_VALUES_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class InvalidMessageError(ValueError):
    """An inbound message failed validation; the message says which field and why."""


@dataclass(frozen=True)
class CheckedBlock:
    """A validated draft block, decoded: row j of ``draft_probs`` is the q ``token_ids[j]``
    came from. A ``top<M>`` block stays sparse (what the verification rules take as is)."""

    request_id: str
    step: int
    num_committed: int
    token_ids: list[int]  # [k]
    # dense: [k, vocab] float32; top<M>: [k, M] ids and float32 values. Rows sum to 1.
    draft_probs: torch.Tensor | SparseDraftProbs
    num_target_features: int = 0  # leading target feature rows the draft holds (FC drafts)


def _tensor_to_pb(tensor: WireTensor) -> pb.Tensor:
    return pb.Tensor(data=tensor.data, dtype=tensor.dtype, shape=list(tensor.shape))


def _tensor_from_pb(message: pb.Tensor, field: str) -> torch.Tensor:
    try:
        return WireTensor(message.data, message.dtype, tuple(message.shape)).to_tensor()
    except ValueError as error:
        raise InvalidMessageError(f"{field}: {error}") from None


def block_to_pb(
    request_id: str,
    step: int,
    num_committed: int,
    token_ids: list[int],
    encoded: EncodedDraftProbs | None,  # [k, ...]: the bytes q was decoded from, unchanged
    num_target_features: int = 0,
) -> pb.DraftBlock:
    if encoded is None:  # an empty block: nothing proposed this round
        return pb.DraftBlock(
            request_id=request_id,
            step=step,
            num_committed=num_committed,
            num_target_features=num_target_features,
        )
    probs = pb.DraftProbs(
        encoding=encoded.encoding,
        vocab_size=encoded.vocab_size,
        values=_tensor_to_pb(encoded.values),
    )
    if encoded.token_ids is not None:
        probs.token_ids.CopyFrom(_tensor_to_pb(encoded.token_ids))
    return pb.DraftBlock(
        request_id=request_id,
        step=step,
        num_committed=num_committed,
        token_ids=token_ids,
        draft_probs=probs,
        num_target_features=num_target_features,
    )


def check_block(message: pb.DraftBlock, vocab_size: int) -> CheckedBlock:
    """Validate and decode an inbound block, or raise InvalidMessageError."""
    if not message.request_id or len(message.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidMessageError(f"request_id must be 1..{MAX_REQUEST_ID_CHARS} characters")
    token_ids = list(message.token_ids)
    k = len(token_ids)
    if not 0 <= k <= MAX_SPEC_LEN:
        raise InvalidMessageError(f"k must be in [0, {MAX_SPEC_LEN}], got {k}")
    if k == 0:  # the draft had nothing to propose: this round runs target-only, no waiting
        empty = torch.zeros(0, vocab_size)
        return CheckedBlock(
            message.request_id,
            message.step,
            message.num_committed,
            [],
            empty,
            message.num_target_features,
        )
    bad = [token_id for token_id in token_ids if not 0 <= token_id < vocab_size]
    if bad:
        raise InvalidMessageError(f"token_ids holds {bad[0]}, outside [0, {vocab_size})")
    probs = message.draft_probs
    try:
        encoding = DraftProbsEncoding.parse(probs.encoding)
    except ValueError as error:
        raise InvalidMessageError(str(error)) from None
    if probs.vocab_size != vocab_size:
        raise InvalidMessageError(f"vocab_size must be {vocab_size}, got {probs.vocab_size}")
    values = _tensor_from_pb(probs.values, "draft_probs.values")
    values_dtype = torch.float32 if encoding.sparse else _VALUES_DTYPES[encoding.name]
    if values.dtype != values_dtype:
        raise InvalidMessageError(
            f"draft_probs.values must be {values_dtype} for encoding {encoding.name!r}, "
            f"got {values.dtype}"
        )
    if encoding.sparse:
        expected = (k, min(encoding.top_m, vocab_size))
        ids = _tensor_from_pb(probs.token_ids, "draft_probs.token_ids")
        if tuple(ids.shape) != expected or ids.dtype != torch.int32:
            raise InvalidMessageError(f"draft_probs.token_ids must be int32 {expected}")
        if bool(((ids < 0) | (ids >= vocab_size)).any()):
            raise InvalidMessageError(f"draft_probs.token_ids must be in [0, {vocab_size})")
        if any(len(set(row)) != len(row) for row in ids.tolist()):
            raise InvalidMessageError("draft_probs.token_ids repeats an id within a row")
    else:
        expected = (k, vocab_size)
    if tuple(values.shape) != expected:
        raise InvalidMessageError(
            f"draft_probs.values must have shape {expected}, got {tuple(values.shape)}"
        )
    values64 = values.double()
    if not bool(torch.isfinite(values64).all()) or bool((values64 < 0).any()):
        raise InvalidMessageError("draft_probs must be finite and non-negative")
    sums = values64.sum(dim=-1)
    # Dense rows carry a whole distribution; sparse rows its top-M mass (renormalised on decode).
    low = 0.0 if encoding.sparse else 1 - ROW_SUM_TOLERANCE
    if not bool(((sums > low) & (sums <= 1 + ROW_SUM_TOLERANCE)).all()):
        worst = float(sums[(sums - 1).abs().argmax()])
        raise InvalidMessageError(f"draft_probs rows must sum to 1, got a row summing to {worst}")
    encoded = EncodedDraftProbs(
        probs.encoding,
        vocab_size,
        WireTensor(probs.values.data, probs.values.dtype, tuple(probs.values.shape)),
        WireTensor(probs.token_ids.data, probs.token_ids.dtype, tuple(probs.token_ids.shape))
        if encoding.sparse
        else None,
    )
    # Decode row by row, as the draft did, so both ends hold bit-identical q.
    drafted = torch.tensor(token_ids)  # [k]
    if encoding.sparse:
        rows = [decode_sparse_draft_probs(encoded.row(j)) for j in range(k)]
        draft_probs = SparseDraftProbs(
            torch.cat([row.token_ids for row in rows]),  # [k, M]
            torch.cat([row.values for row in rows]),  # [k, M]
            vocab_size,
        )
        matches = draft_probs.token_ids == drafted[:, None]  # [k, M], one at most
        at_draft = (draft_probs.values * matches).sum(dim=-1)  # [k]
    else:
        draft_probs = torch.cat([decode_draft_probs(encoded.row(j)) for j in range(k)])
        at_draft = draft_probs[torch.arange(k), drafted]  # [k]
    if not bool((at_draft > 0).all()):
        position = int((at_draft <= 0).nonzero()[0])
        raise InvalidMessageError(f"draft_probs is 0 at drafted token {position} (q(d) > 0)")
    return CheckedBlock(
        message.request_id,
        message.step,
        message.num_committed,
        token_ids,
        draft_probs,
        message.num_target_features,
    )


def features_to_pb(verdict: pb.Verdict, rows: torch.Tensor, start: int) -> None:
    """Attach target feature rows ``[n, hidden]`` (positions start .. start + n - 1) to a
    verdict, as bfloat16: they only steer the draft (see the proto)."""
    wire = WireTensor.from_tensor(rows.to(torch.bfloat16))
    verdict.target_features.CopyFrom(_tensor_to_pb(wire))
    verdict.features_start = start


def check_verdict_features(
    verdict: pb.Verdict, feature_size: int
) -> tuple[int, torch.Tensor] | None:
    """The verdict's target feature rows as ``(start, [n, feature_size] float32)``, None when
    it carries none; InvalidMessageError when they are malformed or not finite."""
    if not verdict.HasField("target_features"):
        return None
    rows = _tensor_from_pb(verdict.target_features, "target_features")
    if rows.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InvalidMessageError(f"target_features must be floating point, got {rows.dtype}")
    if rows.dim() != 2 or rows.shape[1] != feature_size:
        raise InvalidMessageError(
            f"target_features must have shape [n, {feature_size}], got {tuple(rows.shape)}"
        )
    rows = rows.float()
    if not bool(torch.isfinite(rows).all()):
        raise InvalidMessageError("target_features must be finite")
    return verdict.features_start, rows


def grpc_options() -> list[tuple[str, int]]:
    """Channel / server options: explicit message size limits (never unlimited)."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]
