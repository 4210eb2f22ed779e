"""Model loading (local directory, GGUF, the bundled default) and the batched ModelRunner."""

from specray.models.loading import (
    DEFAULT_MODEL,
    LoadedModel,
    ModelSourceError,
    load_model,
    resolve_model_dir,
)
from specray.models.runner import ModelRunner

__all__ = [
    "DEFAULT_MODEL",
    "LoadedModel",
    "ModelRunner",
    "ModelSourceError",
    "load_model",
    "resolve_model_dir",
]
