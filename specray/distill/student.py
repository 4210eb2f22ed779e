"""The distilled draft: a few decoder layers at the target's width on the target's own frozen
embeddings, with an optional reduced-vocabulary head.

The student is a ``LlamaForCausalLM``-family model (the target's architecture with fewer layers)
whose ``lm_head`` is a :class:`ReducedVocabHead`: logits are computed for ``head_vocab`` tokens
and are ``-inf`` everywhere else, so q is exactly zero outside the head and verification stays
exact (a token the draft cannot propose is simply never proposed; the target's residual covers
it). The saved directory holds the layers, the head and the ids it covers; the embeddings are
referenced from the target (``specray_draft.json``), never copied.

A feature-conditioned student (:class:`FeatureDraftModel`, EAGLE: Li et al. 2024) also reads,
at each position i, a feature f_{i-1}: the target's final-norm hidden state h_{i-1} where the
target computed it (zeros at i = 0), else the draft's own output g_{i-1} ("chained"). Its input
is ``fc(cat([e(x_i), f_{i-1}]))``; its marker says ``"feature_conditioned": true``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from specray.distill import DRAFT_FILE, is_distilled_draft

WEIGHTS_FILE = "draft.safetensors"
FORMAT_VERSION = 1


class ReducedVocabHead(nn.Module):
    """``hidden [n, H] -> logits [n, vocab]``: ``-inf`` outside ``vocab_ids``."""

    def __init__(self, weight: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.weight = nn.Parameter(weight)  # [head_vocab, H]
        self.register_buffer("vocab_ids", vocab_ids.to(torch.int64))  # [head_vocab]
        self.out_features = vocab_size  # the runner reads the full vocabulary size here
        self.bias = None

        self._weight_t: torch.Tensor | None = None  # [H, head_vocab], inference only
        self._int8: nn.Module | None = None  # an int8 copy of the weight (quantize), inference

    def train(self, mode: bool = True):
        self._weight_t = None  # weights may change: drop the transposed copy
        if mode:
            self._int8 = None  # ... and the int8 one
        return super().train(mode)

    def quantize(self) -> None:
        """Compute inference logits from an int8 copy of the weight (models/int8.py)."""
        from specray.models.int8 import Int8Linear, packable

        if packable(self.weight.shape[1]):
            self._int8 = Int8Linear.from_weight(self.weight)

    def reduced(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the head's tokens only: ``[..., head_vocab]`` (training uses these)."""
        if self._int8 is not None and not self.training and not torch.is_grad_enabled():
            return self._int8(hidden)
        one_row = hidden.dim() == 2 and hidden.shape[0] == 1
        fp32 = self.weight.dtype == torch.float32  # (an fp16 matrix transposed is 12x slower)
        if one_row and fp32 and not self.training and not torch.is_grad_enabled():
            # A draft step's single row: a pre-transposed copy of the weight is ~2x faster on CPU.
            if self._weight_t is None:
                self._weight_t = self.weight.detach().t().contiguous()
            return hidden @ self._weight_t
        return nn.functional.linear(hidden, self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        small = self.reduced(hidden)  # [..., head_vocab]
        out = small.new_full((*small.shape[:-1], self.out_features), float("-inf"))
        out[..., self.vocab_ids] = small
        return out  # [..., vocab]


def vocabulary_fingerprint(tokenizer) -> str:
    """A digest of the token -> id map: a draft refuses a target with another vocabulary."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def layer_sources(num_target_layers: int, num_layers: int) -> list[int]:
    """Target layers the student's layers start from: evenly spaced, first and last included
    (the first reads embeddings, the last writes what the head reads)."""
    if num_layers > num_target_layers:
        raise ValueError(
            f"num_layers must be <= the target's {num_target_layers} layers, got {num_layers}"
        )
    if num_layers == 1:
        return [num_target_layers - 1]
    step = (num_target_layers - 1) / (num_layers - 1)
    return [round(index * step) for index in range(num_layers)]


def build_student(target: nn.Module, num_layers: int, vocab_ids: torch.Tensor | None):
    """A student initialised from the target: chosen layers, final norm, head rows; the
    embedding module is the target's own (shared, frozen)."""
    from transformers import AutoModelForCausalLM

    config = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = num_layers
    config.tie_word_embeddings = False
    if hasattr(config, "layer_types") and config.layer_types is not None:
        config.layer_types = config.layer_types[:num_layers]
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    target_decoder = target.get_decoder()
    decoder = student.get_decoder()
    sources = layer_sources(len(target_decoder.layers), num_layers)
    for layer, source in zip(decoder.layers, sources, strict=True):
        layer.load_state_dict(target_decoder.layers[source].state_dict())
    decoder.norm.load_state_dict(target_decoder.norm.state_dict())
    decoder.embed_tokens = target_decoder.embed_tokens  # shared: referenced, not copied
    decoder.embed_tokens.weight.requires_grad_(False)
    head_weight = target.get_output_embeddings().weight.detach()  # [vocab, H]
    vocab_size = head_weight.shape[0]
    if vocab_ids is None:
        vocab_ids = torch.arange(vocab_size)
    head = ReducedVocabHead(head_weight[vocab_ids].clone().float(), vocab_ids, vocab_size)
    student.set_output_embeddings(head)
    student.config.specray_layer_sources = sources
    return student


class FeatureDraftModel(nn.Module):
    """A student whose input at each position mixes the token's embedding with a feature:
    ``fc(cat([embed(x_i), f_{i-1}]))`` -> the student's decoder -> norm -> head. The state
    dict is the plain student's (``model.*``, ``lm_head.*``) plus ``fc.*``."""

    def __init__(self, student: nn.Module, fc: nn.Linear | None = None):
        super().__init__()
        self.config = student.config
        self.model = student.get_decoder()  # layers and norm; embed_tokens is the target's
        self.lm_head = student.get_output_embeddings()
        hidden_size = self.config.hidden_size
        if fc is None:  # starts as the plain student: the embedding through, the feature ignored
            fc = nn.Linear(2 * hidden_size, hidden_size)
            with torch.no_grad():
                fc.weight.zero_()
                fc.weight[:, :hidden_size] = torch.eye(hidden_size)
                fc.bias.zero_()
        self.fc = fc

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def get_decoder(self) -> nn.Module:
        return self.model

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def embed_with_features(self, input_ids: torch.Tensor, features: torch.Tensor):
        """input_ids ``[b, T]``, features ``[b, T, H]`` (row t: f_{t-1}) -> ``[b, T, H]``."""
        embeds = self.model.embed_tokens(input_ids)  # [b, T, H]
        return self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))

    def forward(self, input_ids, features, attention_mask=None) -> torch.Tensor:
        """Teacher-forced hidden states ``[b, T, H]`` (training; serving goes through the
        runner, which passes the same ``embed_with_features`` with a KV cache)."""
        embeds = self.embed_with_features(input_ids, features)
        return self.model(inputs_embeds=embeds, attention_mask=attention_mask).last_hidden_state


def trainable_state(student: nn.Module) -> dict[str, torch.Tensor]:
    """Everything the draft directory stores: all weights but the shared embeddings."""
    return {
        name: tensor for name, tensor in student.state_dict().items() if "embed_tokens" not in name
    }


def save_draft(student: nn.Module, folder: Path, target_source: str, tokenizer, info: dict):
    """Write the draft's files into ``folder`` (fp16 weights, loaded back as fp32). Each file is
    replaced atomically and the marker goes last: a directory is a draft only once complete."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in trainable_state(student).items():
        floating = tensor.is_floating_point()
        state[name] = (tensor.to(torch.float16) if floating else tensor).contiguous()
    head = student.get_output_embeddings()
    marker = {
        "format": FORMAT_VERSION,
        "target": target_source,
        "vocab_size": int(head.out_features),
        "head_vocab": int(head.vocab_ids.numel()),
        "vocabulary_sha256": vocabulary_fingerprint(tokenizer) if tokenizer else None,
        "feature_conditioned": isinstance(student, FeatureDraftModel),
        **info,
    }
    (folder / DRAFT_FILE).unlink(missing_ok=True)
    save_file(state, str(folder / f".{WEIGHTS_FILE}.tmp"))
    os.replace(folder / f".{WEIGHTS_FILE}.tmp", folder / WEIGHTS_FILE)
    student.config.to_json_file(str(folder / ".config.json.tmp"))
    os.replace(folder / ".config.json.tmp", folder / "config.json")
    (folder / f".{DRAFT_FILE}.tmp").write_text(json.dumps(marker, indent=2) + "\n")
    os.replace(folder / f".{DRAFT_FILE}.tmp", folder / DRAFT_FILE)


def read_marker(folder: Path) -> dict:
    return json.loads((Path(folder) / DRAFT_FILE).read_text())


def is_feature_conditioned_draft(path: str | Path) -> bool:
    return is_distilled_draft(path) and bool(read_marker(path).get("feature_conditioned"))


class CastEmbedding(nn.Module):
    """The target's embedding module, shared (never converted), with its rows cast to the
    draft's dtype: an fp16 draft must not turn the target's embeddings into fp16."""

    def __init__(self, embeddings: nn.Embedding, dtype: torch.dtype):
        super().__init__()
        self.embeddings, self.dtype = embeddings, dtype

    @property
    def weight(self) -> torch.Tensor:  # [vocab, H], the target's
        return self.embeddings.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., H]
        return self.embeddings(input_ids).to(self.dtype)


def load_draft(
    folder: str | Path,
    embeddings: nn.Embedding,
    vocab_size: int,
    tokenizer,
    dtype: torch.dtype = torch.float32,
):
    """The draft in ``folder`` on the given (target's) embeddings, shared not copied; eval, its
    own weights in ``dtype`` (the embeddings stay as they are; their rows are cast).

    Raises ``VocabularyMismatchError`` when the target's vocabulary is not the one the draft
    was distilled for.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from specray.drafters.model import VocabularyMismatchError

    folder = Path(folder)
    marker = read_marker(folder)
    if marker.get("format") != FORMAT_VERSION:
        raise ValueError(f"draft {str(folder)!r}: unknown format {marker.get('format')!r}")
    if marker["vocab_size"] != vocab_size:
        raise VocabularyMismatchError(
            f"draft {str(folder)!r} was distilled for a {marker['vocab_size']}-token vocabulary "
            f"but the target's has {vocab_size}: a draft must share the target's tokenizer"
        )
    expected = marker.get("vocabulary_sha256")
    if expected and tokenizer is not None and vocabulary_fingerprint(tokenizer) != expected:
        raise VocabularyMismatchError(
            f"draft {str(folder)!r} was distilled for another tokenizer (same size, "
            "different token ids): a draft must share the target's tokenizer"
        )
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = load_file(str(folder / WEIGHTS_FILE))
    head = ReducedVocabHead(state["lm_head.weight"].float(), state["lm_head.vocab_ids"], vocab_size)
    student.set_output_embeddings(head)
    student.get_decoder().embed_tokens = embeddings  # the target's module
    if marker.get("feature_conditioned", False):
        student = FeatureDraftModel(student)  # its fc weights come with the rest below
    floats = {
        name: tensor.float() if tensor.is_floating_point() else tensor
        for name, tensor in state.items()
    }
    missing, unexpected = student.load_state_dict(floats, strict=False)
    missing = [name for name in missing if "embed_tokens" not in name]
    if missing or unexpected:
        raise ValueError(
            f"draft {str(folder)!r}: weights do not match its config "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    return set_draft_dtype(student.eval(), dtype)


def quantize_draft(student):
    """The draft in bfloat16 with its decoder layers' linears and its head computing from
    weight-only int8 copies (models/int8.py), in place; the shared embeddings stay the
    target's."""
    from specray.models.int8 import ACTIVATION_DTYPE, quantize_linears

    set_draft_dtype(student, ACTIVATION_DTYPE)
    quantize_linears(student.get_decoder().layers)
    student.get_output_embeddings().quantize()
    return student


def set_draft_dtype(student, dtype: torch.dtype):
    """Convert a loaded draft's own weights to ``dtype`` in place; the shared embeddings stay
    the target's (their rows are cast on the way in)."""
    if dtype == torch.float32:
        return student
    decoder = student.get_decoder()
    decoder.layers.to(dtype)
    decoder.norm.to(dtype)
    student.get_output_embeddings().to(dtype)
    if isinstance(student, FeatureDraftModel):
        student.fc.to(dtype)
    if not isinstance(decoder.embed_tokens, CastEmbedding):
        decoder.embed_tokens = CastEmbedding(decoder.embed_tokens, dtype)
    decoder.embed_tokens.dtype = dtype
    return student
