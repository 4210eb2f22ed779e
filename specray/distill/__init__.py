"""Distilling a compact draft model from any causal LM target (``specray distill``)."""

# Marks a distilled draft directory (written by specray distill, read by the loaders); here, in
# the package's light __init__, so that code which must not import torch can look for it.
DRAFT_FILE = "specray_draft.json"
