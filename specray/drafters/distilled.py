"""Distilled drafts (``specray distill`` output) on the target's shared embeddings."""

from __future__ import annotations

from pathlib import Path

import torch

from specray.models.loading import LoadedModel


def target_embeddings(target: LoadedModel) -> torch.nn.Embedding:
    """The target's input embeddings: its own module when loaded here, else read from its files
    (a draft worker holds no target weights; it reads just this one tensor)."""
    if target.model is not None:
        return target.model.get_input_embeddings()
    from safetensors import safe_open

    for path in sorted(Path(target.path).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            names = [n for n in weights.keys() if n.endswith("embed_tokens.weight")]  # noqa: SIM118
            if names:
                tensor = weights.get_tensor(names[0]).float()
                return torch.nn.Embedding.from_pretrained(tensor, freeze=True)
    raise ValueError(f"target {str(target.path)!r} has no embed_tokens weight in safetensors")


def load_distilled(
    folder: str | Path,
    target: LoadedModel,
    target_vocab_size: int,
    dtype: str = "auto",
    device: torch.device | None = None,
):
    """The draft in ``folder`` on the target's embeddings (no copy when loaded here), its
    weights in ``dtype`` (``"fp32"``, ``"fp16"``, ``"bf16"``, ``"int8"``: weight-only int8 on
    the CPU, models/int8.py; ``"auto"``: on the CPU whichever computes a draft step's single
    rows fastest, measured once per machine; bfloat16 on an accelerator ``device``)."""
    from specray.distill.student import load_draft, quantize_draft, set_draft_dtype
    from specray.models.int8 import int8_available
    from specray.models.linears import INT8, ROW_DTYPES, fastest_row_dtype

    on_cpu = device is None or torch.device(device).type == "cpu"
    if dtype != "auto" and dtype not in (*ROW_DTYPES, INT8):
        raise ValueError(
            f"draft dtype must be 'auto' or one of {[*ROW_DTYPES, INT8]}, got {dtype!r}"
        )
    if dtype == INT8 and not (on_cpu and int8_available()):
        raise ValueError(
            f"draft dtype 'int8' runs on the CPU with torch's int8-weight kernel, not on {device}"
        )
    draft = load_draft(folder, target_embeddings(target), target_vocab_size, target.tokenizer)
    if dtype == "auto" and not on_cpu:
        dtype = "bf16"
    elif dtype == "auto":
        shapes = [tuple(m.weight.shape) for m in draft.modules() if hasattr(m, "out_features")]
        candidates = (*ROW_DTYPES, INT8) if int8_available() else tuple(ROW_DTYPES)
        dtype = fastest_row_dtype(shapes, candidates)
    if dtype == INT8:
        return quantize_draft(draft)
    return set_draft_dtype(draft, ROW_DTYPES[dtype])
