"""Limits of a round, torch-free: configs check against them in processes that run no model."""

MAX_SPEC_LEN = 32  # the most draft tokens one round may verify
