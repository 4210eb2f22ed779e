"""Exact wire encodings of a draft distribution q (docs/design.md 1.2 and 3).

A compressed q is a *different proposal*, not an approximation: the draft samples from
``decode(encode(q))`` and the target verifies against the same decoded q, so exactness holds
for every encoding. :func:`quantize_draft_probs` is that round trip, done once by the draft.

Encodings (``DraftProbsEncoding.parse``):
  - ``"fp32"``: dense float32 (lossless);
  - ``"fp16"`` / ``"bf16"``: dense half precision (fp16 flushes p < ~6e-8 to zero, bf16 keeps
    the range with fewer mantissa bits);
  - ``"top<M>"`` (e.g. ``"top64"``): sparse, the M most likely ids with float32 values.
Decoding renormalises each row in float64 so it sums to 1; a sparse row is renormalised by
the float64 sum of its M values, so its sparse form (:class:`SparseDraftProbs`, what the target
verifies with) and its dense form (what the draft samples from) hold the same float32 values.
Tensors travel as raw little-endian bytes with their dtype and shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_DENSE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_WIRE_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
}


@dataclass(frozen=True)
class DraftProbsEncoding:
    name: str  # "fp32" | "fp16" | "bf16" | "top<M>"
    top_m: int | None = None  # sparse: number of kept ids per row

    @classmethod
    def parse(cls, name: str) -> DraftProbsEncoding:
        if name in _DENSE_DTYPES:
            return cls(name)
        match = re.fullmatch(r"top(\d+)", name)
        if match and int(match.group(1)) >= 1:
            return cls(name, int(match.group(1)))
        raise ValueError(
            f"draft_probs_encoding must be one of fp32, fp16, bf16 or top<M> (M >= 1), got {name!r}"
        )

    @property
    def sparse(self) -> bool:
        return self.top_m is not None


# A one-hot q (prompt lookup's drafts, a greedy request's) says only its id: 8 bytes a row.
POINT_MASS_ENCODING = DraftProbsEncoding("top1", 1)


@dataclass(frozen=True)
class WireTensor:
    """A tensor as raw little-endian bytes with its dtype name and shape."""

    data: bytes
    dtype: str  # a key of _WIRE_DTYPES
    shape: tuple[int, ...]

    @staticmethod
    def from_tensor(tensor: torch.Tensor) -> WireTensor:
        names = [key for key, value in _WIRE_DTYPES.items() if value == tensor.dtype]
        if not names:
            raise ValueError(
                f"tensor dtype must be one of {sorted(_WIRE_DTYPES)}, got {tensor.dtype}"
            )
        name = names[0]
        host = tensor.detach().to("cpu").contiguous()  # the wire carries host bytes
        raw = host.view(torch.uint8).numpy().tobytes()  # CPU torch is little-endian
        return WireTensor(raw, name, tuple(tensor.shape))

    def row(self, index: int) -> WireTensor:
        """Row ``index`` of a 2-D tensor as a ``[1, ...]`` tensor (a byte slice)."""
        row_bytes = len(self.data) // self.shape[0]
        data = self.data[index * row_bytes : (index + 1) * row_bytes]
        return WireTensor(data, self.dtype, (1, *self.shape[1:]))

    def to_tensor(self) -> torch.Tensor:
        if self.dtype not in _WIRE_DTYPES:
            raise ValueError(f"unknown wire dtype {self.dtype!r}")
        dtype = _WIRE_DTYPES[self.dtype]
        # Negative dims can multiply to the right byte count ((-1, -V)), then reshape fails.
        if any(size < 0 for size in self.shape):
            raise ValueError(f"wire tensor shape must not have negative dims, got {self.shape}")
        count = 1
        for size in self.shape:
            count *= size
        if len(self.data) != count * dtype.itemsize:
            raise ValueError(
                f"wire tensor of shape {self.shape} and dtype {self.dtype} needs "
                f"{count * dtype.itemsize} bytes, got {len(self.data)}"
            )
        if count == 0:
            return torch.empty(self.shape, dtype=dtype)
        flat = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        return flat.view(dtype).reshape(self.shape).clone()


@dataclass(frozen=True)
class EncodedDraftProbs:
    """q for ``[k, vocab]`` as sent on the wire."""

    encoding: str
    vocab_size: int
    values: WireTensor  # dense: [k, vocab]; sparse: [k, M] float32
    token_ids: WireTensor | None = None  # sparse: [k, M] int32

    @property
    def num_bytes(self) -> int:
        return len(self.values.data) + (len(self.token_ids.data) if self.token_ids else 0)

    @property
    def num_rows(self) -> int:
        return self.values.shape[0]

    def row(self, index: int) -> EncodedDraftProbs:
        """Row ``index`` as its own ``[1, ...]`` message (decoding is per row, see stack_rows)."""
        return EncodedDraftProbs(
            self.encoding,
            self.vocab_size,
            self.values.row(index),
            self.token_ids.row(index) if self.token_ids is not None else None,
        )


def point_mass_rows(token_ids: list[int], vocab_size: int) -> list[EncodedDraftProbs]:
    """One-hot q at each of ``token_ids``, one ``top1`` row each: what
    :func:`encode_draft_probs` makes of those one-hot rows, byte for byte, without them."""
    return [
        EncodedDraftProbs(
            POINT_MASS_ENCODING.name,
            vocab_size,
            WireTensor.from_tensor(torch.ones(1, 1, dtype=torch.float32)),
            WireTensor.from_tensor(torch.tensor([[token_id]], dtype=torch.int32)),
        )
        for token_id in token_ids
    ]


def _point_mass_as(row: EncodedDraftProbs, like: EncodedDraftProbs) -> EncodedDraftProbs:
    """A one-row point mass (``top1``) in ``like``'s encoding, decoding to the same one-hot q:
    a sparse row gets zero weights on other ids, a dense row is the one-hot vector."""
    if row.encoding == like.encoding or row.vocab_size != like.vocab_size:
        return row
    token_id = int(row.token_ids.to_tensor().reshape(-1)[0])
    if like.token_ids is not None:
        width = like.values.shape[1]
        others = [i for i in range(width) if i != token_id][: width - 1]
        values = torch.zeros(1, width)
        values[0, 0] = row.values.to_tensor().reshape(-1)[0]
        token_ids = torch.tensor([[token_id, *others]], dtype=torch.int32)
        return EncodedDraftProbs(
            like.encoding,
            row.vocab_size,
            WireTensor.from_tensor(values),
            WireTensor.from_tensor(token_ids),
        )
    one_hot = torch.zeros(1, row.vocab_size, dtype=_DENSE_DTYPES[like.encoding])
    one_hot[0, token_id] = 1
    return EncodedDraftProbs(like.encoding, row.vocab_size, WireTensor.from_tensor(one_hot))


def stack_rows(rows: list[EncodedDraftProbs]) -> EncodedDraftProbs:
    """Concatenate one-row messages into one ``[k, ...]`` message, bytes unchanged.

    The draft decodes each row as it samples; the receiver decodes row by row again with
    :meth:`EncodedDraftProbs.row`, so both see bit-identical q (rule 2 of the contract).
    """
    # A block may mix drafters (prompt lookup's point masses, then a model's q): point masses
    # take the model's encoding, which holds them exactly.
    first = next((row for row in rows if row.encoding != "top1"), rows[0])
    rows = [_point_mass_as(row, first) if row.encoding == "top1" else row for row in rows]
    if any(row.encoding != first.encoding or row.vocab_size != first.vocab_size for row in rows):
        raise ValueError("stacked rows must share one encoding and vocabulary")

    def stack(tensors: list[WireTensor]) -> WireTensor:
        shape = (sum(t.shape[0] for t in tensors), *tensors[0].shape[1:])
        return WireTensor(b"".join(t.data for t in tensors), tensors[0].dtype, shape)

    values = stack([row.values for row in rows])
    token_ids = stack([row.token_ids for row in rows]) if first.token_ids is not None else None
    return EncodedDraftProbs(first.encoding, first.vocab_size, values, token_ids)


def encode_draft_probs(
    draft_probs: torch.Tensor, encoding: DraftProbsEncoding
) -> EncodedDraftProbs:
    """draft_probs: ``[k, vocab]`` -> wire form."""
    vocab = draft_probs.shape[-1]
    if encoding.sparse:
        top_m = min(encoding.top_m, vocab)
        values, token_ids = torch.topk(draft_probs.float(), top_m, dim=-1)  # [k, M] each
        return EncodedDraftProbs(
            encoding.name,
            vocab,
            WireTensor.from_tensor(values),
            WireTensor.from_tensor(token_ids.to(torch.int32)),
        )
    dense = draft_probs.to(_DENSE_DTYPES[encoding.name])
    return EncodedDraftProbs(encoding.name, vocab, WireTensor.from_tensor(dense))


@dataclass(frozen=True)
class SparseDraftProbs:
    """A decoded ``top<M>`` q, kept sparse: row j puts ``values[j, i]`` on ``token_ids[j, i]``
    and 0 on every other id of the vocabulary."""

    token_ids: torch.Tensor  # [k, M] int64, distinct within a row
    values: torch.Tensor  # [k, M] float32, each row renormalised in float64 to sum to 1
    vocab_size: int

    @property
    def num_rows(self) -> int:
        return self.token_ids.shape[0]

    @classmethod
    def point_masses(cls, token_ids: torch.Tensor, vocab_size: int) -> SparseDraftProbs:
        """Row j puts all its mass on ``token_ids[j]`` (``[k]`` int64, on q's device): a greedy
        draft's q, or a lookup's, without a vocabulary row per token."""
        ids = token_ids.to(torch.int64).reshape(-1, 1)  # [k, 1]
        return cls(ids, torch.ones(ids.shape, dtype=torch.float32, device=ids.device), vocab_size)

    def to_dense(self) -> torch.Tensor:
        """The same q as a float32 ``[k, vocab]`` tensor (what the draft samples from)."""
        dense = torch.zeros(
            self.num_rows, self.vocab_size, dtype=torch.float32, device=self.values.device
        )
        return dense.scatter_(-1, self.token_ids, self.values)


def dense_draft_probs(draft_probs: torch.Tensor | SparseDraftProbs) -> torch.Tensor:
    """A block's q as a float32 ``[k, vocab]`` tensor, whichever form it is kept in."""
    if isinstance(draft_probs, SparseDraftProbs):
        return draft_probs.to_dense()
    return draft_probs


def decode_sparse_draft_probs(encoded: EncodedDraftProbs) -> SparseDraftProbs:
    """A ``top<M>`` wire form -> its q, sparse; each row renormalised by its values' sum."""
    if encoded.token_ids is None:
        raise ValueError(f"encoding {encoded.encoding!r} is dense, not top<M>")
    values = encoded.values.to_tensor().double()  # [k, M]
    normalised = (values / values.sum(dim=-1, keepdim=True)).to(torch.float32)
    return SparseDraftProbs(encoded.token_ids.to_tensor().long(), normalised, encoded.vocab_size)


def decode_draft_probs(encoded: EncodedDraftProbs) -> torch.Tensor:
    """Wire form -> float32 ``[k, vocab]``, each row renormalised to sum to 1."""
    if encoded.token_ids is not None:
        return decode_sparse_draft_probs(encoded).to_dense()
    dense = encoded.values.to_tensor().double()  # [k, vocab]
    return (dense / dense.sum(dim=-1, keepdim=True)).to(torch.float32)


def quantize_draft_probs(draft_probs: torch.Tensor, encoding: DraftProbsEncoding) -> torch.Tensor:
    """What the draft samples from and the target verifies against: decode(encode(q)).

    Across a wire, send the encoded rows themselves (never re-encode a decoded q) and decode
    them row by row: decode is deterministic per row, so both ends hold the same q.
    """
    if encoding.name == "fp32":
        return draft_probs.float()
    return decode_draft_probs(encode_draft_probs(draft_probs, encoding))
