"""The exactness core: pure torch, no I/O."""

from specray.sampling.encoding import (
    DraftProbsEncoding,
    EncodedDraftProbs,
    WireTensor,
    decode_draft_probs,
    encode_draft_probs,
    quantize_draft_probs,
    stack_rows,
)
from specray.sampling.params import SamplingParams, SamplingParamsError
from specray.sampling.pipeline import LogitsPipeline
from specray.sampling.rng import KeyedRandom, Purpose, keyed_uniform, sample_from_probs
from specray.sampling.verify import (
    MAX_SPEC_LEN,
    PLACEHOLDER_TOKEN_ID,
    BatchVerifyResult,
    VerifyResult,
    VerifyUniforms,
    verify_batch,
    verify_batch_greedy,
    verify_batch_greedy_ids,
    verify_block,
)

__all__ = [
    "MAX_SPEC_LEN",
    "PLACEHOLDER_TOKEN_ID",
    "BatchVerifyResult",
    "DraftProbsEncoding",
    "EncodedDraftProbs",
    "KeyedRandom",
    "LogitsPipeline",
    "Purpose",
    "SamplingParams",
    "SamplingParamsError",
    "VerifyResult",
    "VerifyUniforms",
    "WireTensor",
    "decode_draft_probs",
    "encode_draft_probs",
    "keyed_uniform",
    "quantize_draft_probs",
    "sample_from_probs",
    "stack_rows",
    "verify_batch",
    "verify_batch_greedy",
    "verify_batch_greedy_ids",
    "verify_block",
]
