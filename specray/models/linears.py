"""Small-batch linears on CPU, tuned by measurement: kernel and row padding per row count.

A decode step and a verification step both multiply a handful of rows (1 token; k + 1 tokens;
a few requests' blocks) by every weight matrix. That is memory-bound: reading the weights costs
the same for 1 row as for 8, so verifying k + 1 tokens should cost about one decode step. The
default GEMM path does not behave that way; oneDNN with weights packed once for this CPU does.
Milliseconds per pass through the default target's 210 decoder linears (2 threads, weights
streamed from memory; an AMD EPYC with AVX-512):

    rows                 1     2     3     4     6     8    16
    F.linear          34.7  49.8  57.9  45.2  59.3  47.9  57.0
    oneDNN packed     19.3  21.4  17.0  16.3  15.6  20.7  25.8
    head, F.linear     9.5  21.4    -   15.6  22.4  15.9    -
    head, oneDNN       2.7   3.0   2.7   2.5   2.4   3.6   5.1

Which kernel wins, and for how many rows, depends on the CPU and its libraries, so it is
measured here: for each row count m in 1..16, every candidate kernel computing m' >= m rows
(zeros appended, result sliced: each row of a product is computed on its own, so padding
changes no row beyond float rounding) is timed on the model's own linears, and the cheapest
plan is kept. Above 16 rows (verifying a batch's blocks) a few larger counts are timed, and
each count runs unpadded with the kernel that won at the next one measured: one core here,
64 rows took 204 ms through F.linear and 146 ms through oneDNN. Measurements are cached on
disk per (CPU, threads, dtype, shapes, torch), so a machine pays for calibration once (about
20 seconds for the default target); concurrent processes wait for one calibration under a file
lock. Models whose linears fit in cache (tiny test models) are left alone: nothing to gain.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

MAX_TUNED_ROWS = 16  # row counts measured one by one, where padding may pay
# Row counts measured above that (a batch verifying blocks: 8 requests x 5 tokens = 40 rows);
# between two of them the kernel that won at the larger one runs, unpadded.
LARGE_ROW_COUNTS = (24, 32, 48, 64, 96, 128)
MIN_TUNED_BYTES = 32 * 2**20  # linears smaller than this in all stay cache-resident: skip
MIN_GAIN = 0.08  # leave the default plan only for one at least 8% cheaper
CALIBRATION_REPEATS = 3
DENSE, DENSE_T, ONEDNN = "dense", "dense_t", "onednn"  # F.linear; x @ W^T pre-transposed; packed


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` packed for oneDNN's linear on this CPU (opaque)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def onednn_linear(rows: torch.Tensor, packed: torch.Tensor, bias) -> torch.Tensor:
    """``rows`` ``[n, in]`` times a :func:`onednn_pack` weight, plus ``bias``: ``[n, out]``."""
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, bias, "none", [], "")


def choose_plan(
    costs_s: Mapping[str, Sequence[float]], min_gain: float = MIN_GAIN
) -> tuple[tuple[str, int], ...]:
    """For each row count ``m`` (``costs_s[kernel][m - 1]`` = measured seconds for ``m`` rows),
    the (kernel, rows to compute) to use: the cheapest over every kernel and every ``m' >= m``,
    if it is at least ``min_gain`` cheaper than the dense kernel on ``m`` rows (and a padded
    option at least ``min_gain`` cheaper than its kernel unpadded), else ``("dense", m)``.
    Index 0 is unused. Pure.

    >>> choose_plan({"dense": [34.7, 49.8, 57.9, 45.2], "onednn": [19.3, 21.4, 17.0, 16.3]})
    (('dense', 0), ('onednn', 4), ('onednn', 4), ('onednn', 3), ('onednn', 4))
    """
    dense = costs_s[DENSE]
    plan = [(DENSE, 0)]
    for rows in range(1, len(dense) + 1):
        best = (dense[rows - 1], DENSE, rows)
        for kernel, kernel_costs in costs_s.items():
            own = kernel_costs[rows - 1]
            option = (own, kernel, rows)  # padding must pay for itself within a kernel too
            for other in range(rows + 1, len(kernel_costs) + 1):
                if kernel_costs[other - 1] <= min(option[0], (1.0 - min_gain) * own):
                    option = (kernel_costs[other - 1], kernel, other)
            if option[0] <= min(best[0], (1.0 - min_gain) * dense[rows - 1]):
                best = option
        plan.append(best[1:])
    return tuple(plan)


def extend_plan(
    plan: tuple[tuple[str, int], ...],
    costs_s: Mapping[str, Sequence[float]],
    row_counts: Sequence[int],
    min_gain: float = MIN_GAIN,
) -> tuple[tuple[str, int], ...]:
    """``plan`` (rows 0 .. len - 1) extended to ``row_counts[-1]`` rows: ``costs_s[kernel][i]``
    is the measured seconds for ``row_counts[i]`` rows; each row count up to ``row_counts[i]``
    (above the previous one) runs unpadded with the kernel cheapest there, if it is at least
    ``min_gain`` cheaper than the dense kernel. Pure.

    >>> extend_plan(((DENSE, 0), (ONEDNN, 1)), {DENSE: [5.0, 9.0], ONEDNN: [3.0, 8.9]}, [2, 3])
    (('dense', 0), ('onednn', 1), ('onednn', 2), ('dense', 3))
    """
    extended = list(plan)
    for index, count in enumerate(row_counts):
        dense = costs_s[DENSE][index]
        kernel, cost = min(((k, c[index]) for k, c in costs_s.items()), key=lambda kc: kc[1])
        if cost > (1.0 - min_gain) * dense:
            kernel = DENSE
        extended.extend((kernel, rows) for rows in range(len(extended), count + 1))
    return tuple(extended)


class TunedLinear(nn.Module):
    """A linear layer computing ``m`` rows the way ``plan[m]`` says (kernel, padded rows).

    Keeps the original ``weight`` / ``bias`` parameters (same names, same storage: state dicts
    and tied weights unchanged) and adds the kernel-specific copies the plan uses: a packed
    oneDNN weight (opaque, this CPU only) and/or a pre-transposed ``[in, out]`` matrix.
    """

    def __init__(self, linear: nn.Linear, plan: tuple[tuple[str, int], ...] = ()):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # [out, in], [out]
        self.packed = self.weight_t = None
        self.set_plan(plan)

    def set_plan(self, plan, kernels=None) -> None:
        """Use ``plan``; build the copies for ``kernels`` (default: those the plan uses) and
        drop the others."""
        self.plan = tuple(plan)
        wanted = set(kernels) if kernels is not None else {kernel for kernel, _ in self.plan}
        weight = self.weight.detach()
        with torch.no_grad():
            self.packed = onednn_pack(weight) if ONEDNN in wanted and onednn_available() else None
            self.weight_t = weight.t().contiguous() if DENSE_T in wanted else None  # [in, out]

    def run(self, flat: torch.Tensor, kernel: str) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if kernel == ONEDNN:
            return onednn_linear(flat, self.packed, self.bias)
        if kernel == DENSE_T:
            out = flat @ self.weight_t
            return out if self.bias is None else out + self.bias
        return F.linear(flat, self.weight, self.bias)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = inputs.numel() // self.in_features
        if rows < len(self.plan):
            kernel, padded = self.plan[rows]
        else:  # past the measured counts: the largest one's kernel
            kernel, padded = (self.plan[-1][0] if len(self.plan) > 1 else DENSE), rows
        if (kernel, padded) == (DENSE, rows):
            return F.linear(inputs, self.weight, self.bias)
        flat = inputs.reshape(rows, self.in_features)  # [rows, in]
        if padded > rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, self.in_features)])
        out = self.run(flat, kernel)[:rows]  # [rows, out]
        return out.reshape(*inputs.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        changed = {rows: step for rows, step in enumerate(self.plan) if step != (DENSE, rows)}
        return f"in_features={self.in_features}, out_features={self.out_features}, plan={changed}"


def _time_pass(linears: Sequence[TunedLinear], kernel: str, rows: int) -> float:
    """Best-of-``CALIBRATION_REPEATS`` seconds of ``rows`` rows through every linear with
    ``kernel``. The linears are many and large, so each pass streams weights from memory, as a
    real forward does."""
    inputs = {
        lin.in_features: torch.randn(rows, lin.in_features).to(lin.weight.dtype) for lin in linears
    }

    def one_pass() -> None:
        for linear in linears:
            linear.run(inputs[linear.in_features], kernel)

    return _best_of(one_pass)


def _best_of(one_pass) -> float:
    """Best-of-``CALIBRATION_REPEATS`` seconds of ``one_pass()``, after one pass to warm up."""
    best = float("inf")
    for attempt in range(CALIBRATION_REPEATS + 1):
        started = time.perf_counter()
        one_pass()
        if attempt:
            best = min(best, time.perf_counter() - started)
    return best


def tuned_row_counts() -> list[int]:
    """The row counts measured: 1..MAX_TUNED_ROWS, then LARGE_ROW_COUNTS above it."""
    return [*range(1, MAX_TUNED_ROWS + 1), *(n for n in LARGE_ROW_COUNTS if n > MAX_TUNED_ROWS)]


def measure_costs(linears: Sequence[TunedLinear], kernels: Sequence[str]) -> dict[str, list]:
    """Seconds per pass for each of tuned_row_counts(), per kernel."""
    with torch.inference_mode():
        return {
            kernel: [_time_pass(linears, kernel, rows) for rows in tuned_row_counts()]
            for kernel in kernels
        }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cached(key: list, measure) -> dict:
    """``measure()``'s result, cached on disk under ``key`` (plus this CPU, its threads and the
    torch version). Concurrent processes wait under a file lock and read the first one's."""
    from specray.models.loading import cache_dir

    key = [*key, cpu_model(), torch.get_num_threads(), torch.__version__, tuned_row_counts()]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    path = cache_dir() / "linear-tuning" / f"{digest}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return json.loads(path.read_text())["measured"]
        except (OSError, ValueError, KeyError):
            pass
        measured = measure()
        scratch = path.with_suffix(".tmp")
        scratch.write_text(json.dumps({"measured": measured, "key": key}))
        scratch.replace(path)
        return measured


def _shapes(linears: Sequence[nn.Module]) -> list:
    return sorted({(lin.out_features, lin.in_features) for lin in linears})


def _cached_costs(role: str, linears: Sequence[TunedLinear], kernels: Sequence[str]) -> dict:
    def measure():
        for linear in linears:
            linear.set_plan((), kernels=kernels)
        return measure_costs(linears, kernels)

    dtype = str(linears[0].weight.dtype)
    return _cached([role, dtype, len(linears), _shapes(linears), list(kernels)], measure)


ROW_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
INT8 = "int8"  # weight-only int8 with bfloat16 rows (models/int8.py)


def _time_int8_pass(shapes: Sequence[tuple[int, int]]) -> float:
    """Best-of seconds of one row through int8 linears of ``shapes`` (bfloat16 where the
    kernel cannot take the input width), as :func:`_time_pass`."""
    from specray.models.int8 import ACTIVATION_DTYPE, Int8Linear, packable

    modules = []
    for out, width in shapes:
        linear = nn.Linear(width, out, bias=False)
        modules.append(
            Int8Linear.from_linear(linear) if packable(width) else linear.to(ACTIVATION_DTYPE)
        )
    inputs = {width: torch.randn(1, width, dtype=ACTIVATION_DTYPE) for _, width in shapes}

    def one_pass() -> None:
        for module, (_, width) in zip(modules, shapes, strict=True):
            module(inputs[width])

    return _best_of(one_pass)


def fastest_row_dtype(
    shapes: Sequence[tuple[int, int]], candidates: Sequence[str] = tuple(ROW_DTYPES)
) -> str:
    """Of ``candidates`` (``"fp32"``, ``"fp16"``, ``"bf16"``, ``"int8"``), whichever computes
    one row through matrices of ``shapes`` (``[out, in]`` each) fastest on this CPU, fp32
    through oneDNN where it has it, int8 as weight-only int8 (models/int8.py).
    For a draft, whose precision changes its q but never the output's law. Measured once per
    machine (random weights; a few hundred milliseconds)."""

    def measure():
        seconds = {}
        with torch.inference_mode():
            for name in candidates:
                if name == INT8:
                    seconds[name] = _time_int8_pass(shapes)
                    continue
                dtype = ROW_DTYPES[name]
                tuned = [TunedLinear(nn.Linear(i, o, bias=False).to(dtype)) for o, i in shapes]
                kernel = ONEDNN if dtype == torch.float32 and onednn_available() else DENSE
                for linear in tuned:
                    linear.set_plan((), kernels=[kernel])
                seconds[name] = _time_pass(tuned, kernel, 1)
        return seconds

    key = ["row-dtype", [list(shape) for shape in shapes], list(candidates)]
    seconds = _cached(key, measure)
    return min(seconds, key=seconds.get)


def _tune(role: str, tuned: Sequence[TunedLinear], kernels: Sequence[str]) -> dict:
    costs_s = _cached_costs(role, tuned, kernels)  # builds every kernel's copies if it measures
    counts = tuned_row_counts()
    plan = extend_plan(
        choose_plan({kernel: costs[:MAX_TUNED_ROWS] for kernel, costs in costs_s.items()}),
        {kernel: costs[MAX_TUNED_ROWS:] for kernel, costs in costs_s.items()},
        counts[MAX_TUNED_ROWS:],
    )
    for linear in tuned:
        linear.set_plan(plan)
    return {"costs_s": costs_s, "plan": plan}


def _eligible(linear: nn.Module) -> bool:
    """Plain CPU fp32 linears without hooks (a tensor-parallel row-split layer carries an
    all-reduce hook and is left alone)."""
    return (
        type(linear) is nn.Linear
        and linear.weight.device.type == "cpu"
        and linear.weight.dtype == torch.float32
        and not linear._forward_hooks
        and not linear._forward_pre_hooks
    )


def tune_decoder_linears(decoder: nn.Module, *, min_bytes: int | None = None) -> dict | None:
    """Replace the decoder's eligible linears by ``TunedLinear`` with a measured plan; returns
    the costs and plan (``None``: nothing eligible or too small to gain)."""
    found = [
        (parent, name, child)
        for parent in decoder.modules()
        for name, child in parent.named_children()
        if _eligible(child)
    ]
    total_bytes = sum(lin.weight.numel() * lin.weight.element_size() for *_, lin in found)
    if not found or total_bytes < (MIN_TUNED_BYTES if min_bytes is None else min_bytes):
        return None
    kernels = [DENSE, ONEDNN] if onednn_available() else [DENSE]
    tuned = []
    for parent, name, linear in found:
        replacement = TunedLinear(linear)
        setattr(parent, name, replacement)
        tuned.append(replacement)
    return _tune("decoder", tuned, kernels)


def tune_head(head: nn.Module, *, min_bytes: int | None = None) -> TunedLinear | None:
    """A ``TunedLinear`` computing ``head``'s logits with a measured plan (the head module
    itself is not replaced: its weight is usually tied to the input embeddings)."""
    head_bytes = head.weight.numel() * head.weight.element_size() if _eligible(head) else 0
    if not head_bytes or head_bytes < (MIN_TUNED_BYTES if min_bytes is None else min_bytes):
        return None
    tuned = TunedLinear(head)
    kernels = [DENSE, DENSE_T] + ([ONEDNN] if onednn_available() else [])
    _tune("head", [tuned], kernels)
    return tuned
