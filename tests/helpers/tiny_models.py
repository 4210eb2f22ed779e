"""The tests' name for :mod:`specray.models.random_models` (tiny random-weight models and the
exact sequence distribution), which ``scripts/gpu-check`` shares."""

from specray.models.random_models import (
    exact_sequence_probs,
    last_logits,
    perturbed_copy,
    save_tiny_chat_pair,
    tiny_llama,
)

# A two-layer grouped-query decoder's config keywords (any family's config takes them).
TINY_DECODER = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

__all__ = [
    "TINY_DECODER",
    "exact_sequence_probs",
    "last_logits",
    "perturbed_copy",
    "save_tiny_chat_pair",
    "tiny_llama",
]
