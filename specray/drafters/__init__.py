"""Proposal sources behind one small protocol (:class:`Drafter`)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

from specray.data import measured_drafts_file
from specray.distill import is_distilled_draft
from specray.drafters.base import DraftBlock, Drafter, DraftRequest
from specray.drafters.chain import FirstFoundDrafter
from specray.drafters.digest import model_digest
from specray.drafters.distilled import load_distilled
from specray.drafters.feature import FeatureDrafter
from specray.drafters.model import ModelDrafter, VocabularyMismatchError, check_same_vocabulary
from specray.drafters.ngram import NgramConfig, NgramDrafter, find_continuation
from specray.models.loading import LoadedModel, ModelInfo, load_model
from specray.models.runner import ModelRunner
from specray.sampling import DraftProbsEncoding

# "self:<dtype>" derives the draft from the target's own weights at a cheaper precision
# ("self:auto": fp16 or bf16, whichever computes a step faster on this CPU, measured once);
# "self:int8" quantises its linear layers (int8 weights, dynamic activation scales).
SELF_DRAFT_DTYPES = {"self:bf16": "bfloat16", "self:fp16": "float16", "self:fp32": "float32"}
SELF_DRAFTS = (*SELF_DRAFT_DTYPES, "self:auto", "self:int8")
# The distilled draft shipped for the default target; "distilled:fp32|fp16|bf16" pins its
# precision, plain "distilled" (like a distilled directory) takes this CPU's fastest.
SHIPPED_DRAFT = "distilled"
MEASURED_DRAFT = "auto"  # the winner of `specray bench --drafters all` ("default" is the same)
FALLBACK_DRAFT = "self:auto"  # for a target with no measurement: works for any target


def shipped_draft_dir() -> Path:
    return Path(str(resources.files("specray.data").joinpath("drafts", "smollm2-135m-instruct")))


def measured_winner(target: LoadedModel | ModelInfo, path: Path | None = None) -> str:
    """The drafter ``specray bench --drafters all --record`` measured fastest for this target
    (matched by :func:`model_digest`), else :data:`FALLBACK_DRAFT`."""
    path = path or measured_drafts_file()
    if not path.exists() or target.path is None:
        return FALLBACK_DRAFT
    record = json.loads(path.read_text())
    if record.get("target_digest") != model_digest(target.path):
        return FALLBACK_DRAFT
    return record["winner"]["draft"]


def resolve_draft_name(draft: str, target: LoadedModel | ModelInfo) -> str:
    """``"default"`` / ``"auto"`` -> the measured winner; other names are returned as given.
    ``target``: the loaded target, or its description (only its directory is read)."""
    return measured_winner(target) if draft in {"default", MEASURED_DRAFT} else draft


def _load_self_draft(spec: str, target: LoadedModel, draft: str, device: torch.device):
    if target.path is None:
        raise ValueError(
            f"draft {draft!r} derives the draft from the target's files; "
            "an in-memory target has none (pass the draft model itself)"
        )
    if spec == "self:auto":
        spec = "self:bf16" if device.type == "cuda" else f"self:{_fastest_self_dtype(target.path)}"
    if spec != "self:int8":
        dtype = SELF_DRAFT_DTYPES[spec]
        return load_model(str(target.path), dtype=dtype, param="draft", device=device)
    if device.type != "cpu":
        raise ValueError(
            f"draft {draft!r}: int8 dynamic quantisation runs on the CPU only; on {device} use "
            "'self:bf16' or 'self:fp16'"
        )
    loaded = load_model(str(target.path), dtype="float32", param="draft")
    return LoadedModel(quantize_int8(loaded.model), loaded.tokenizer, loaded.path)


def target_device(target: LoadedModel) -> torch.device:
    """Where the target's weights are (the CPU for a target known by its files only): a model
    drafter runs beside them unless told otherwise."""
    if target.model is None:
        return torch.device("cpu")
    return next(target.model.parameters()).device


def _fastest_self_dtype(target_dir: Path) -> str:
    """fp16 or bf16 for a self-draft: the faster for one row through the target's linears."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specray.models.linears import fastest_row_dtype

    config = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    with torch.device("meta"):  # shapes only: no memory, no weights read
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = [tuple(m.weight.shape) for m in skeleton.modules() if isinstance(m, torch.nn.Linear)]
    return fastest_row_dtype(shapes, candidates=("fp16", "bf16"))


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """int8 dynamic quantisation of the decoder's linear layers: int8 weights with one scale
    per output channel (greedy agreement 0.55 vs 0.52 per-tensor on the default target, and
    faster here), activations quantised per call. The head stays fp32: it has a faster
    pre-transposed path, and the runner reads its weight."""
    import warnings

    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch marks its quantised tensors as deprecated
        quantize_dynamic(
            model.get_decoder(),
            {torch.nn.Linear: per_channel_dynamic_qconfig},
            dtype=torch.qint8,
            inplace=True,
        )
    return model


def _model_drafter(spec, draft, target, target_vocab_size, encoding, keep_encoded, device):
    distilled_dtype = "auto"
    if spec == SHIPPED_DRAFT or spec.startswith(f"{SHIPPED_DRAFT}:"):
        distilled_dtype = spec.partition(":")[2] or "auto"
        if distilled_dtype not in ("auto", "fp32", "fp16", "bf16", "int8"):
            raise ValueError(
                f"draft must be 'distilled' or 'distilled:fp32|fp16|bf16|int8', got {draft!r}"
            )
        spec = str(shipped_draft_dir())
        if not is_distilled_draft(spec):
            raise ValueError(f"draft {draft!r}: the shipped draft is missing from {spec}")
    if spec in SELF_DRAFTS:
        loaded = _load_self_draft(spec, target, draft, device)
        runner = ModelRunner(loaded.model)
        check_same_vocabulary(
            target.tokenizer, loaded.tokenizer, target_vocab_size, runner.vocab_size
        )
    elif spec.startswith("self:"):
        raise ValueError(f"draft must be one of {list(SELF_DRAFTS)}, got {draft!r}")
    elif is_distilled_draft(spec):  # checks the vocabulary against the target's itself
        draft_model = load_distilled(spec, target, target_vocab_size, distilled_dtype, device)
        draft_model = draft_model.to(device)  # embeddings shared with a target there stay put
        runner = ModelRunner(draft_model)
        if hasattr(draft_model, "embed_with_features"):  # marker: "feature_conditioned": true
            return FeatureDrafter(runner, encoding, keep_encoded=keep_encoded)
    else:
        loaded = load_model(spec, param="draft", device=device)
        runner = ModelRunner(loaded.model)
        check_same_vocabulary(
            target.tokenizer, loaded.tokenizer, target_vocab_size, runner.vocab_size
        )
    return ModelDrafter(
        runner,
        encoding,
        keep_encoded=keep_encoded,
        shares_target_architecture=spec in SELF_DRAFTS,
    )


def make_drafter(
    draft: str | None,
    target: LoadedModel,
    target_vocab_size: int,
    encoding: DraftProbsEncoding,
    *,
    keep_encoded: bool = False,
    device: torch.device | None = None,
) -> Drafter | None:
    """``None`` (target-only); ``"ngram"``; ``"self:auto|bf16|fp16|fp32|int8"``; ``"distilled"``
    or ``"distilled:fp32|fp16|bf16|int8"`` (the shipped draft of the default target); a distilled
    draft directory (feature-conditioned or not: its marker says) or a model path;
    ``"ngram+<any of those>"`` (prompt lookup first); ``"default"`` / ``"auto"`` (the measured
    winner for this target). Model drafters run on ``device`` (default: the target's)."""
    if draft is None:
        return None
    device = device if device is not None else target_device(target)
    if not isinstance(draft, str):
        raise ValueError(f"draft must be a string or None, got {draft!r}")
    spec = resolve_draft_name(draft, target)
    if spec == "none":
        return None
    if spec == "ngram":
        return NgramDrafter(target_vocab_size, keep_encoded=keep_encoded)
    if spec.startswith("ngram+"):
        rest = spec.removeprefix("ngram+")
        if rest in {"ngram", "", "default", MEASURED_DRAFT} or rest.startswith("ngram+"):
            raise ValueError(f"draft 'ngram+X' needs a model drafter as X, got {draft!r}")
        then = _model_drafter(
            rest, draft, target, target_vocab_size, encoding, keep_encoded, device
        )
        chain = FirstFoundDrafter(NgramDrafter(target_vocab_size, keep_encoded=keep_encoded), then)
        # The engine keeps target features when the model part reads them.
        chain.needs_target_features = getattr(then, "needs_target_features", False)
        return chain
    return _model_drafter(spec, draft, target, target_vocab_size, encoding, keep_encoded, device)


__all__ = [
    "FALLBACK_DRAFT",
    "SELF_DRAFTS",
    "DraftBlock",
    "DraftRequest",
    "Drafter",
    "FeatureDrafter",
    "FirstFoundDrafter",
    "ModelDrafter",
    "NgramConfig",
    "NgramDrafter",
    "VocabularyMismatchError",
    "check_same_vocabulary",
    "find_continuation",
    "make_drafter",
    "model_digest",
    "resolve_draft_name",
]
