"""Which model a directory holds, cheaply and independently of the library that wrote it: the
measured drafter of ``specray/data/drafters.json`` applies to the target it was measured on.

A digest of the files' bytes changed with every transformers release (``config.json`` carries
``transformers_version``, and the safetensors header's metadata and layout may move), so a
fresh install with a newer transformers no longer recognised the bundled target and fell back
to a self draft. This digest reads what identifies the model instead: the architecture's
fields of ``config.json``, every tensor's name, dtype and shape, and the first bytes of one
tensor's data (found through the header, wherever the writer put it)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

ARCHITECTURE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)
SAMPLE_BYTES = 1 << 20  # of the first tensor's data (by name)


def model_digest(model_dir: str | Path) -> str:
    """A hex digest of the model in ``model_dir`` (a transformers directory with safetensors
    weights); equal for two directories holding the same weights and architecture, whatever
    wrote them."""
    folder = Path(model_dir)
    digest = hashlib.sha256(b"specray-model-digest-2")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    architecture = {name: config.get(name) for name in ARCHITECTURE_FIELDS}
    digest.update(json.dumps(architecture, sort_keys=True).encode())
    tensors: dict[str, dict] = {}
    sample: tuple[str, Path, int, dict] | None = None  # (name, file, data start, entry)
    for weights in sorted(folder.glob("*.safetensors")):
        header, data_start = _header(weights)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            tensors[name] = {"dtype": entry["dtype"], "shape": entry["shape"]}
            if sample is None or name < sample[0]:
                sample = (name, weights, data_start, entry)
    digest.update(json.dumps(tensors, sort_keys=True).encode())
    if sample is not None:
        _, weights, data_start, entry = sample
        begin, end = entry["data_offsets"]
        with weights.open("rb") as handle:
            handle.seek(data_start + begin)
            digest.update(handle.read(min(end - begin, SAMPLE_BYTES)))
    return digest.hexdigest()


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data
    starts."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length)), 8 + length
