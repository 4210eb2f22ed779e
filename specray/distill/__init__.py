"""Distilling a compact draft model from any causal LM target (``specray distill``)."""
