"""specray: exact speculative decoding, distributed."""

from specray.engine import Engine, EngineInputError
from specray.outputs import RequestOutput, SpecDecodeMetrics
from specray.sampling import SamplingParams, SamplingParamsError

__all__ = [
    "Engine",
    "EngineInputError",
    "RequestOutput",
    "SamplingParams",
    "SamplingParamsError",
    "SpecDecodeMetrics",
]
__version__ = "0.1.0"
