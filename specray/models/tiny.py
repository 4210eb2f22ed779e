"""A tiny random-weight Llama over the bundled tokenizer, made on the spot (no downloads).

Its forward pass costs well under a millisecond, so what a benchmark measures with it is the
serving machinery around the model (front ends, Ray, gRPC), and tests run whole requests fast.
"""

from __future__ import annotations

from pathlib import Path


def save_tiny_model(folder: str | Path, *, seed: int = 0, max_positions: int = 1024) -> str:
    """Write the model and the bundled model's tokenizer (with its chat template) to
    ``folder``; returns the directory, loadable wherever a model directory is."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specray.models.loading import load_tokenizer, resolve_model_dir

    folder = Path(folder)
    tokenizer = load_tokenizer(resolve_model_dir("default"))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
