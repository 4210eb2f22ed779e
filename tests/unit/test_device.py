"""The device contract (specray/models/device.py): spellings, clear refusals, and the runner's
hot path kept on its model's device.

The device check: a model built on the meta device makes every tensor it computes a meta
tensor, and an op mixing a meta tensor with a CPU one fails. A runner that built an index,
mask or input on the CPU would fail here, as it would on a GPU (the runner of commit 3845dfc
did, on its first forward).
"""

import pytest
import torch
from pydantic import ValidationError
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specray.engine import Engine, EngineInputError
from specray.models.device import (
    DeviceError,
    default_dtype,
    resolve_device,
    worker_device,
)
from specray.models.runner import ModelRunner
from specray.serve.config import AppArgs
from tests.helpers.tiny_models import TINY_DECODER

CUDA = torch.cuda.is_available()
TINY = TINY_DECODER


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:x", "CPU", "", 3, None, "mps"])
def test_a_misspelt_device_is_refused_naming_the_parameter_and_value(spec):
    with pytest.raises(DeviceError, match=f"device must be one of .*got {spec!r}"):
        resolve_device(spec)


def test_cpu_and_auto_resolve_here():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda", 0) if CUDA else torch.device("cpu"))


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:7"])
def test_cuda_without_cuda_fails_at_start_naming_the_device(spec):
    if CUDA and int(spec.partition(":")[2] or 0) < torch.cuda.device_count():
        assert resolve_device(spec).type == "cuda"
        return
    with pytest.raises(DeviceError, match=f"device='{spec}'"):
        resolve_device(spec)


def test_weights_default_to_bf16_on_cuda_and_fp32_on_the_cpu():
    assert default_dtype(torch.device("cpu")) == "float32"
    assert default_dtype(torch.device("cuda", 0)) == "bfloat16"
    assert default_dtype(torch.device("cuda", 0), "float16") == "float16"
    with pytest.raises(DeviceError, match=r"dtype must be one of .*got 'fp8'"):
        default_dtype(torch.device("cpu"), "fp8")


def test_a_ray_worker_takes_the_gpu_ray_gave_it_or_refuses_cuda_without_one():
    assert worker_device("auto", gpu_ids=[]) == torch.device("cpu")
    with pytest.raises(DeviceError, match="Ray gave this worker no GPU"):
        worker_device("cuda", gpu_ids=[])
    if not CUDA:  # Ray assigned a GPU, but this process cannot use CUDA: no silent CPU
        with pytest.raises(DeviceError, match="CUDA is not available"):
            worker_device("auto", gpu_ids=["0"])


def test_the_engine_refuses_an_unavailable_or_misspelt_device_before_loading():
    with pytest.raises(EngineInputError, match=r"device must be one of .*got 'gpu'"):
        Engine("default", draft=None, device="gpu")
    with pytest.raises(EngineInputError, match=r"dtype must be one of .*got 'fp8'"):
        Engine("default", draft=None, dtype="fp8")
    if not CUDA:
        with pytest.raises(EngineInputError, match=r"device=.cuda.*CUDA is not available"):
            Engine("default", draft=None, device="cuda")


def test_app_args_and_placement_check_the_device():
    with pytest.raises(ValidationError, match=r"device must be one of .*got 'tpu'"):
        AppArgs(device="tpu")
    with pytest.raises(ValidationError, match="target_num_gpus and draft_num_gpus must be > 0"):
        AppArgs(device="cuda")
    args = AppArgs(device="cuda", target_num_gpus=1, draft_num_gpus=0.5)
    assert args.placement().device == "cuda"


def test_an_in_process_engine_on_the_cpu_runs_there():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    engine = Engine(model, draft=None, device="cpu")
    assert engine.target.device == torch.device("cpu")


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch-invariant"])
@pytest.mark.parametrize(
    "model_class,config_class", [(LlamaForCausalLM, LlamaConfig), (Qwen2ForCausalLM, Qwen2Config)]
)
def test_every_runner_tensor_lives_on_the_model_device(model_class, config_class, batch_invariant):
    """Prefill, ragged decoding, a rollback, rows moved by a removal, a cache that grows and
    one imported from another runner: all on the meta device, logits included."""
    config = config_class(**TINY)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = model_class(config).eval()
    runner = ModelRunner(model, tune=False, batch_invariant=batch_invariant)
    assert runner.device == torch.device("meta")
    logits = runner.forward({"a": list(range(1, 9)), "b": [3, 4, 5]}, {"a": 1, "b": 3})
    assert {seq_id: (rows.device.type, rows.shape[0]) for seq_id, rows in logits.items()} == {
        "a": ("meta", 1),
        "b": ("meta", 3),
    }
    runner.rollback("b", 2)
    for step in range(3):  # a third row joins; rows of different lengths decode together
        feeds = {"a": [step + 1], "b": [7, 8], **({"c": [1] * 70} if step == 1 else {})}
        logits = runner.forward(feeds, dict.fromkeys(feeds, 1))
        assert all(rows.device.type == "meta" for rows in logits.values())
    runner.remove(["a"])  # "b" and "c" move up
    logits = runner.forward({"c": [2], "b": [2]}, {"c": 1, "b": 1})
    assert all(rows.device.type == "meta" for rows in logits.values())
    other = ModelRunner(model, tune=False)
    other.import_rows(runner, ["c"])
    assert other.length("c") == runner.length("c")
    assert other.cache.layers[0].keys.device.type == "meta"
