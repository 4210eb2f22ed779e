"""The exactness core: pure torch, no I/O."""

from __future__ import annotations

import importlib

# Imported on first use (PEP 562): a process that only validates configs or reads
# one small module of the package does not pay for torch and transformers.
_EXPORTS = {
    "DraftProbsEncoding": "specray.sampling.encoding",
    "EncodedDraftProbs": "specray.sampling.encoding",
    "WireTensor": "specray.sampling.encoding",
    "decode_draft_probs": "specray.sampling.encoding",
    "encode_draft_probs": "specray.sampling.encoding",
    "quantize_draft_probs": "specray.sampling.encoding",
    "stack_rows": "specray.sampling.encoding",
    "SamplingParams": "specray.sampling.params",
    "SamplingParamsError": "specray.sampling.params",
    "LogitsPipeline": "specray.sampling.pipeline",
    "KeyedRandom": "specray.sampling.rng",
    "Purpose": "specray.sampling.rng",
    "keyed_uniform": "specray.sampling.rng",
    "sample_from_probs": "specray.sampling.rng",
    "MAX_SPEC_LEN": "specray.sampling.limits",
    "PLACEHOLDER_TOKEN_ID": "specray.sampling.verify",
    "BatchVerifyResult": "specray.sampling.verify",
    "VerifyResult": "specray.sampling.verify",
    "VerifyUniforms": "specray.sampling.verify",
    "greedy_committed": "specray.sampling.verify",
    "verify_batch": "specray.sampling.verify",
    "verify_batch_greedy": "specray.sampling.verify",
    "verify_batch_greedy_ids": "specray.sampling.verify",
    "verify_block": "specray.sampling.verify",
}


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
    "greedy_committed",
    "keyed_uniform",
    "quantize_draft_probs",
    "sample_from_probs",
    "stack_rows",
    "verify_batch",
    "verify_batch_greedy",
    "verify_batch_greedy_ids",
    "verify_block",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
