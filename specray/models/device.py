"""Where a process runs its models: the device contract (docs/design.md, "Devices").

``device`` is one of ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``, the same spelling in
``Engine``, ``AppArgs``, the CLI (``--device``) and the chart. ``"auto"`` takes a GPU when this
process can see one and the CPU otherwise; ``"cuda"`` / ``"cuda:N"`` on a process that cannot
see that GPU fail at start, naming the device: nothing falls back silently.

A Ray worker sees only the GPUs Ray gave it (Ray sets ``CUDA_VISIBLE_DEVICES``), so
``"cuda"`` there is the first GPU in ``ray.get_gpu_ids()``: :func:`worker_device`.

Weights default to bfloat16 on CUDA and float32 on the CPU (:func:`default_dtype`); ``dtype``
overrides.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported where a device is resolved or timed, not here: configs are validated with
# this module's spelling checks in processes that run no model (the Serve controller, the
# ingress and coordinator replicas).
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


class DeviceError(ValueError):
    """A device or dtype the caller asked for that this process cannot use."""

    def __init__(self, message: str, param: str = "device"):
        super().__init__(message)
        self.param = param


def check_device_spec(spec: object, param: str = "device") -> str:
    """The spelling check alone (no CUDA query): for configs validated where no model runs."""
    if not isinstance(spec, str) or not _PATTERN.fullmatch(spec):
        raise DeviceError(
            f"{param} must be one of {', '.join(DEVICE_CHOICES)}, got {spec!r}", param
        )
    return spec


def check_dtype_spec(dtype: object, param: str = "dtype") -> str:
    if dtype not in DTYPE_CHOICES:
        choices = ", ".join(DTYPE_CHOICES)
        raise DeviceError(f"{param} must be one of {choices}, got {dtype!r}", param)
    return dtype


def resolve_device(spec: str = "auto", param: str = "device") -> torch.device:
    """The device ``spec`` names on this process, or :class:`DeviceError` saying why not.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    import torch

    check_device_spec(spec, param)
    if spec == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if spec == "auto":
        return torch.device("cuda", 0) if available else torch.device("cpu")
    if not available:
        raise DeviceError(
            f"{param}={spec!r}: CUDA is not available to this process (torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); use "
            f"{param}='cpu' or 'auto'",
            param,
        )
    index = int(spec.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(
            f"{param}={spec!r}: this process sees {count} CUDA device(s) (0..{count - 1})", param
        )
    return torch.device("cuda", index)


def worker_device(spec: str = "auto", gpu_ids: list | None = None) -> torch.device:
    """The device of a worker. In a Ray actor, Ray restricts ``CUDA_VISIBLE_DEVICES`` to the
    actor's GPUs (``gpu_ids``, default ``ray.get_gpu_ids()``), so its first assigned GPU is
    ``cuda:0`` there; an actor given no GPU runs ``"auto"`` on the CPU and refuses an explicit
    ``"cuda"`` (the placement and the device disagree). Outside Ray: :func:`resolve_device`."""
    check_device_spec(spec)
    if gpu_ids is None:
        gpu_ids = _ray_actor_gpu_ids()
        if gpu_ids is None:  # not a Ray actor (workers built in process): as anywhere else
            return resolve_device(spec)
    if spec == "auto":
        return resolve_device("cuda" if gpu_ids else "cpu")
    if spec.startswith("cuda") and not gpu_ids:
        raise DeviceError(
            f"device={spec!r}, but Ray gave this worker no GPU: reserve GPUs for it in the "
            f"placement (num_gpus) or use device='auto'"
        )
    return resolve_device(spec)


def _ray_actor_gpu_ids() -> list | None:
    """The GPUs Ray gave this actor, or None outside a Ray actor."""
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return None
    return ray.get_gpu_ids()


def default_dtype(device: torch.device, dtype: str = "auto", param: str = "dtype") -> str:
    """The weights' dtype name: ``dtype`` as given, or for ``"auto"`` bfloat16 on CUDA and
    float32 elsewhere."""
    check_dtype_spec(dtype, param)
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.type == "cuda" else "float32"


class DeviceTimer:
    """Seconds of device work between :meth:`start` and :meth:`stop`: CUDA events on a GPU
    (its work is asynchronous: a host clock would time the launches), the host clock
    elsewhere. :meth:`seconds` waits for the end event; call it once the caller has
    synchronised anyway, e.g. after reading the round's results."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._begin: object = None
        self._end: object = None

    def _mark(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> DeviceTimer:
        self._begin = self._mark()
        return self

    def stop(self) -> DeviceTimer:
        self._end = self._mark()
        return self

    def seconds(self) -> float:
        if not self.cuda:
            return self._end - self._begin
        self._end.synchronize()
        return self._begin.elapsed_time(self._end) / 1000
