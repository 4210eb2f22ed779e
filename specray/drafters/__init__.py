"""Proposal sources behind one small protocol (:class:`Drafter`)."""

from __future__ import annotations

from specray.drafters.base import DraftBlock, Drafter, DraftRequest
from specray.drafters.model import ModelDrafter, VocabularyMismatchError, check_same_vocabulary
from specray.drafters.ngram import NgramConfig, NgramDrafter, find_continuation
from specray.models.loading import LoadedModel, load_model
from specray.models.runner import ModelRunner
from specray.sampling import DraftProbsEncoding

# "self:<dtype>" derives the draft from the target's own weights at a cheaper precision.
SELF_DRAFT_DTYPES = {"self:bf16": "bfloat16", "self:fp16": "float16", "self:fp32": "float32"}
DEFAULT_DRAFT = "self:bf16"  # what draft="default" means until a distilled draft ships


def make_drafter(
    draft: str | None,
    target: LoadedModel,
    target_vocab_size: int,
    encoding: DraftProbsEncoding,
    *,
    keep_encoded: bool = False,
) -> Drafter | None:
    """``None`` (target-only), ``"ngram"``, ``"default"``, ``"self:<dtype>"`` or a model path."""
    if draft is None:
        return None
    if not isinstance(draft, str):
        raise ValueError(f"draft must be a string or None, got {draft!r}")
    if draft == "ngram":
        return NgramDrafter(target_vocab_size, keep_encoded=keep_encoded)
    spec = DEFAULT_DRAFT if draft == "default" else draft
    if spec in SELF_DRAFT_DTYPES:
        if target.path is None:
            raise ValueError(
                f"draft {draft!r} derives the draft from the target's files; "
                "an in-memory target has none (pass the draft model itself)"
            )
        loaded = load_model(str(target.path), dtype=SELF_DRAFT_DTYPES[spec], param="draft")
    elif spec.startswith("self:"):
        raise ValueError(f"draft must be one of {sorted(SELF_DRAFT_DTYPES)}, got {draft!r}")
    else:
        loaded = load_model(spec, param="draft")
    runner = ModelRunner(loaded.model)
    check_same_vocabulary(target.tokenizer, loaded.tokenizer, target_vocab_size, runner.vocab_size)
    return ModelDrafter(
        runner,
        encoding,
        keep_encoded=keep_encoded,
        shares_target_architecture=spec in SELF_DRAFT_DTYPES,
    )


__all__ = [
    "DEFAULT_DRAFT",
    "DraftBlock",
    "DraftRequest",
    "Drafter",
    "ModelDrafter",
    "NgramConfig",
    "NgramDrafter",
    "VocabularyMismatchError",
    "check_same_vocabulary",
    "find_continuation",
    "make_drafter",
]
