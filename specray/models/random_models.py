"""Tiny random-weight causal LMs and the exact sequence distribution of a target under a
sampling configuration (the oracle of the statistical tests and of ``scripts/gpu-check``).

A tiny Llama (vocabulary of a handful of tokens, one or two layers of width 16-32) runs a
generation step in well under a millisecond, so thousands of whole generations fit in seconds,
and its exact distribution over every length-L continuation can be enumerated.

Example: ``tiny_llama(6, seed=0)`` is a 1-layer Llama over 6 tokens whose next-token
distributions are neither flat nor one-hot (logits scaled to a standard deviation of ~1.5), and
``exact_sequence_probs(model, [0, 1], SamplingParams(), 2)`` maps each of the 36 pairs ``(a, b)``
to ``p(a | 0 1) * p(b | 0 1 a)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from copy import deepcopy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specray.sampling import LogitsPipeline, SamplingParams

DEFAULT_LOGIT_STD = 1.5  # raw logits' standard deviation after scaling the head
MAX_POSITIONS = 64


def tiny_llama(
    vocab_size: int,
    seed: int,
    *,
    hidden_size: int = 16,
    intermediate_size: int = 32,
    num_hidden_layers: int = 1,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    logit_std: float = DEFAULT_LOGIT_STD,
    eos_token_id: int | None = None,
) -> LlamaForCausalLM:
    """A random-weight Llama over ``vocab_size`` tokens, in eval mode, deterministic in ``seed``.

    No token is an end-of-sequence token unless ``eos_token_id`` is given (then it is set in the
    generation config too, which is where the engine reads it).
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)  # leave the global RNG as we found it
    model.generation_config.eos_token_id = eos_token_id
    with torch.no_grad():
        # [1, min(vocab, positions)]: every token once while the vocabulary fits the positions
        probe = torch.arange(min(vocab_size, MAX_POSITIONS))[None]
        raw_std = model(probe).logits.std()
        model.lm_head.weight.mul_(logit_std / raw_std)
    return model.eval()


def perturbed_copy(model: LlamaForCausalLM, seed: int, noise: float) -> LlamaForCausalLM:
    """A different model close to ``model``: every weight tensor plus Gaussian noise of
    ``noise`` times that tensor's standard deviation (a draft that agrees often, not always)."""
    copy = deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in copy.parameters():
            scale = noise * float(parameter.std()) if parameter.numel() > 1 else noise
            noise_cpu = torch.randn(parameter.shape, generator=generator)  # seeded on the host
            parameter.add_(noise_cpu.to(parameter.device, parameter.dtype) * scale)
    return copy.eval()


@torch.inference_mode()
def last_logits(model: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """Raw logits of the next token after ``token_ids`` (no cache), float32 ``[vocab]``."""
    device = next(model.parameters()).device
    return model(torch.tensor([list(token_ids)], device=device)).logits[0, -1].float()


def exact_sequence_probs(
    model: torch.nn.Module,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    length: int,
    grammars=None,
) -> dict[tuple[int, ...], float]:
    """The target's exact probability of every length-``length`` continuation.

    Each factor is ``LogitsPipeline(params, vocab, prompt).probs(logits[None], prefix)``: the
    engine's one pipeline, with the history at that position. Sequences of probability 0 are
    included (masked tokens), so the keys are all ``vocab ** length`` sequences.
    """
    vocab_size = int(model.get_output_embeddings().weight.shape[0])
    pipeline = LogitsPipeline(params, vocab_size, prompt_token_ids, grammars=grammars)
    conditionals: dict[tuple[int, ...], torch.Tensor] = {}  # prefix -> [vocab] float64
    for size in range(length):
        for prefix in itertools.product(range(vocab_size), repeat=size):
            logits = last_logits(model, [*prompt_token_ids, *prefix])
            probs = pipeline.probs(logits[None], output_token_ids=list(prefix))[0]
            conditionals[prefix] = probs.double()
    out = {}
    for sequence in itertools.product(range(vocab_size), repeat=length):
        prob = 1.0
        for position, token_id in enumerate(sequence):
            prob *= float(conditionals[sequence[:position]][token_id])
        out[sequence] = prob
    return out


def save_tiny_chat_pair(
    folder, *, seed: int = 0, max_positions: int = 256, num_key_value_heads: int = 1
) -> tuple[str, str]:
    """A tiny random target over the bundled model's tokenizer (49,152 tokens, chat template)
    and a perturbed draft, saved with that tokenizer: text and chat prompts work end to end in
    milliseconds per token. Returns ``(target_dir, draft_dir)``."""
    from pathlib import Path

    from specray.models.loading import load_tokenizer, resolve_model_dir

    folder = Path(folder)
    tokenizer = load_tokenizer(resolve_model_dir("default"))
    target = tiny_llama(
        len(tokenizer),
        seed=seed,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=num_key_value_heads,  # 2: shardable at TP 2
        eos_token_id=tokenizer.eos_token_id,
    )
    target.config.max_position_embeddings = max_positions
    draft = perturbed_copy(target, seed=seed + 1, noise=0.05)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    return str(folder / "target"), str(folder / "draft")
