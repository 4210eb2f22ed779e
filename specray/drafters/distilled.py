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
    folder: str | Path, target: LoadedModel, target_vocab_size: int, dtype: str = "auto"
):
    """The draft model in ``folder`` on the target's embeddings (no copy when loaded here), its
    weights in ``dtype`` (``"fp32"``, ``"fp16"``, ``"bf16"``; ``"auto"``: whichever computes a
    draft step's single rows fastest on this CPU, measured once per machine)."""
    from specray.distill.student import load_draft, set_draft_dtype
    from specray.models.linears import ROW_DTYPES, fastest_row_dtype

    if dtype != "auto" and dtype not in ROW_DTYPES:
        raise ValueError(f"draft dtype must be 'auto' or one of {list(ROW_DTYPES)}, got {dtype!r}")
    draft = load_draft(folder, target_embeddings(target), target_vocab_size, target.tokenizer)
    if dtype == "auto":
        shapes = [tuple(m.weight.shape) for m in draft.modules() if hasattr(m, "out_features")]
        dtype = fastest_row_dtype(shapes)
    return set_draft_dtype(draft, ROW_DTYPES[dtype])
