"""Tensor parallelism for Llama-family models: edit a loaded model in place, gpt-fast style.

Every rank loads the whole model, then keeps only its shard of each decoder layer:

| plan    | modules                                    | split                 | after forward  |
|---------|--------------------------------------------|-----------------------|----------------|
| colwise | q_proj, k_proj, v_proj, gate_proj, up_proj | output rows, and bias | nothing        |
| rowwise | o_proj, down_proj                          | input columns         | all-reduce SUM |

A colwise projection gives each rank whole attention heads (or a slice of the MLP's inner
width); the rowwise projection that follows consumes exactly that slice and yields a partial
sum of the full output, which one all-reduce per module turns into the exact result: 2 per layer.
A rowwise bias is kept on rank 0 only, so the all-reduce adds it once, not ``world_size`` times.
Each rank's KV cache holds only its own ``num_key_value_heads / world_size`` heads.

The embeddings and lm_head stay whole: every rank gets the full logits, so sampling and
verification run unchanged on any rank with no gather of vocabulary shards (the head is a
small share of a large model's weights, and a vocab split would need a gather per step).

transformers' attention reshapes with ``-1`` heads (``hidden_shape = (*input_shape, -1,
self.head_dim)``) and derives ``num_key_value_groups`` as a ratio, which sharding keeps, so the
sharded projections need no change to attention code or config. Ranks must call forward in
lockstep with identical inputs: each call runs ``2 * num_hidden_layers`` collectives.

Why not transformers' own ``tp_plan`` / ``DistributedConfig``: it shards just as exactly, but on
CPU with gloo this hand-written plan is faster (4 all-reduces per step instead of ~6 collectives
plus DTensor overhead; timings in docs/bench/history.md), its DTensor outputs do not mix with
ModelRunner's plain-tensor lm_head, and ``tp_plan="auto"`` silently stays unsharded unless the
``WORLD_SIZE`` env var is set, whereas here rank and world size are arguments.

Example: hidden_size=32, num_attention_heads=4 (head_dim 8), num_key_value_heads=2,
intermediate_size=64 at world size 2. Weights are ``[out, in]``; each rank keeps
q_proj ``[32, 32] -> [16, 32]`` (2 heads), k_proj / v_proj ``[16, 32] -> [8, 32]`` (1 KV head),
gate_proj / up_proj ``[64, 32] -> [32, 32]``, o_proj ``[32, 32] -> [32, 16]``,
down_proj ``[32, 64] -> [32, 32]``.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch import nn

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2"}
COLWISE = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}  # split output rows
ROWWISE = {"o_proj", "down_proj"}  # split input columns, all-reduce the output


# A collective of the forward waits at most this long for the other ranks (they run the same
# forward: only a dead or hung rank makes it wait); idle followers wait on the command group,
# whose leader pings (specray/actors/tp_group.py).
GROUP_TIMEOUT_S = 120.0


def init_process_group_cpu(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str = "gloo",
    timeout_s: float = GROUP_TIMEOUT_S,
) -> None:
    """Join the default process group, e.g. ``init_method="tcp://127.0.0.1:29500"``.

    ``gloo`` is for CPU tensors; on CUDA pass ``"cpu:gloo,cuda:nccl"`` (NCCL all-reduces).
    """
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def apply_tp(model: nn.Module, rank: int, world_size: int, group=None) -> nn.Module:
    """Shard ``model`` in place for ``rank`` of ``world_size`` and return it.

    A no-op at ``world_size == 1`` (any model). Otherwise the process group ``group`` (default:
    the world) must already be initialized with this rank and size.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if world_size == 1:
        return model
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"tensor parallelism supports model_type in {sorted(SUPPORTED_MODEL_TYPES)}, "
            f"got model_type={config.model_type!r}"
        )
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % world_size:
            raise ValueError(f"{name}={value} is not divisible by tp_size={world_size}")
    if not dist.is_initialized():
        raise RuntimeError("apply_tp needs an initialized process group (init_process_group_cpu)")
    group_rank, group_size = dist.get_rank(group), dist.get_world_size(group)
    if (group_rank, group_size) != (rank, world_size):
        raise ValueError(
            f"rank={rank}, world_size={world_size} disagree with the process group "
            f"(rank {group_rank} of {group_size})"
        )

    def all_reduce(_module, _inputs, output):  # partial sums -> full output, in place
        dist.all_reduce(output, op=dist.ReduceOp.SUM, group=group)

    for layer in model.get_decoder().layers:
        for block in (layer.self_attn, layer.mlp):
            for name, linear in block.named_children():
                if name in COLWISE:
                    _shard(linear, "weight", 0, rank, world_size)
                    if linear.bias is not None:
                        _shard(linear, "bias", 0, rank, world_size)
                    linear.out_features //= world_size
                elif name in ROWWISE:
                    _shard(linear, "weight", 1, rank, world_size)
                    if linear.bias is not None and rank != 0:
                        linear.bias = None  # added once, by rank 0, through the all-reduce
                    linear.in_features //= world_size
                    linear.register_forward_hook(all_reduce)
    return model


def _shard(linear: nn.Linear, attr: str, dim: int, rank: int, world_size: int) -> None:
    """Replace ``linear.<attr>`` by its ``rank``-th of ``world_size`` chunks along ``dim``."""
    full = getattr(linear, attr)
    shard = full.detach().chunk(world_size, dim=dim)[rank].clone()  # clone frees the full tensor
    setattr(linear, attr, nn.Parameter(shard, requires_grad=full.requires_grad))
