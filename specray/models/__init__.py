"""Model loading (local directory, GGUF, the bundled default) and the batched ModelRunner."""

from __future__ import annotations

import importlib

# Imported on first use (PEP 562): a process that only validates configs or reads
# one small module of the package does not pay for torch and transformers.
_EXPORTS = {
    "DEFAULT_MODEL": "specray.models.loading",
    "LoadedModel": "specray.models.loading",
    "ModelSourceError": "specray.models.loading",
    "load_model": "specray.models.loading",
    "resolve_model_dir": "specray.models.loading",
    "ModelRunner": "specray.models.runner",
}


__all__ = [
    "DEFAULT_MODEL",
    "LoadedModel",
    "ModelRunner",
    "ModelSourceError",
    "load_model",
    "resolve_model_dir",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
