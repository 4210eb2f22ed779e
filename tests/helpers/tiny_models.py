"""The tests' name for :mod:`specray.models.random_models` (tiny random-weight models and the
exact sequence distribution), which ``scripts/gpu-check`` shares."""

from specray.models.random_models import (
    exact_sequence_probs,
    last_logits,
    perturbed_copy,
    save_tiny_chat_pair,
    tiny_llama,
)

__all__ = [
    "exact_sequence_probs",
    "last_logits",
    "perturbed_copy",
    "save_tiny_chat_pair",
    "tiny_llama",
]
