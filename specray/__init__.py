"""specray: exact speculative decoding, distributed.

The public names load on first use (PEP 562), so ``import specray.client`` (grpc and protobuf
only) works where torch is not installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specray.engine import Engine, EngineInputError
    from specray.outputs import RequestOutput, SpecDecodeMetrics
    from specray.sampling import SamplingParams, SamplingParamsError

_LAZY = {  # public name -> the module that defines it
    "Engine": "specray.engine",
    "EngineInputError": "specray.engine",
    "RequestOutput": "specray.outputs",
    "SpecDecodeMetrics": "specray.outputs",
    "SamplingParams": "specray.sampling",
    "SamplingParamsError": "specray.sampling",
}

__all__ = [
    "Engine",
    "EngineInputError",
    "RequestOutput",
    "SamplingParams",
    "SamplingParamsError",
    "SpecDecodeMetrics",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'specray' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
