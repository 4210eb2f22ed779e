"""Distilling a compact draft model from any causal LM target (``specray distill``)."""

from __future__ import annotations

from pathlib import Path

# Marks a distilled draft directory (written by specray distill, read by the loaders); here, in
# the package's light __init__, so that code which must not import torch can look for it.
DRAFT_FILE = "specray_draft.json"


def is_distilled_draft(path: str | Path) -> bool:
    return (Path(path) / DRAFT_FILE).is_file()
