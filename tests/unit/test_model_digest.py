"""The digest that ties ``specray/data/drafters.json``'s measured drafter to its target: the
bundled target resolves to the recorded winner, and the digest ignores what the writing
library adds (its version, the safetensors metadata, the data's position) while any change to
the weights or the architecture changes it."""

from __future__ import annotations

import json
import struct

from specray.drafters import measured_drafts_file, resolve_draft_name
from specray.drafters.digest import model_digest
from specray.models.loading import load_model_info
from tests.helpers.tiny_models import tiny_llama


def test_the_bundled_target_gets_the_recorded_drafter():
    """A fresh install converts the bundled GGUF with whatever transformers 5.x it has; the
    default drafter must still be the one measured for it, not the fallback self draft."""
    recorded = json.loads(measured_drafts_file().read_text())
    assert resolve_draft_name("default", load_model_info("default")) == recorded["winner"]["draft"]


def _rewrite_header(path, change) -> None:
    """Rewrite a safetensors file's header through ``change(header) -> header``, padding it
    so the data keeps its offsets relative to the header's end."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = change(json.loads(raw[8 : 8 + length]))
    encoded = json.dumps(header).encode()
    encoded += b" " * ((-len(encoded)) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length :])


def test_what_the_writer_adds_is_ignored_and_the_weights_are_not(tmp_path):
    model = tiny_llama(50, seed=0)
    model.save_pretrained(tmp_path)
    digest = model_digest(tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(
        json.dumps(config | {"transformers_version": "9.9.9", "_model_name_or_path": "x"})
    )
    [weights] = tmp_path.glob("*.safetensors")
    _rewrite_header(weights, lambda h: h | {"__metadata__": {"format": "pt", "writer": "other"}})
    assert model_digest(tmp_path) == digest

    config_path.write_text(json.dumps(config | {"num_hidden_layers": 7}))
    assert model_digest(tmp_path) != digest
    config_path.write_text(json.dumps(config))
    assert model_digest(tmp_path) == digest
    raw = bytearray(weights.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    first = min(name for name in header if name != "__metadata__")
    raw[8 + length + header[first]["data_offsets"][0]] ^= 0xFF  # a byte of the sampled tensor
    weights.write_bytes(bytes(raw))
    assert model_digest(tmp_path) != digest
    other = tiny_llama(50, seed=1)
    other.save_pretrained(tmp_path / "other")
    assert model_digest(tmp_path / "other") != digest
