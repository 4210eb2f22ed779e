"""Peak memory of a target rank while it loads its weights, at TP = 1 and TP = 2.

A random Llama-shaped model (about 1.1B parameters by default: TinyLlama's shape) is saved as
safetensors in a temporary directory; then one process loads it whole (TP = 1, the path of
``load_model``) and two processes load it as a tensor-parallel group over gloo (each reads its
own shard, ``load_model_shard``). Each process reads every weight once (as its first forward would:
weights mapped from the files become resident then) and reports its peak resident set size
(``VmHWM``); the figure of interest is the TP = 2 rank's over TP = 1's.
"""

from __future__ import annotations

import json
import resource
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp


@dataclass(frozen=True)
class TpMemoryConfig:
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 22
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    vocab_size: int = 32000


def _save_random_model(config: TpMemoryConfig, folder: Path) -> int:
    """Writes the model; returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**asdict(config), tie_word_embeddings=False))
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.02)
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    return count


def _peak_rss_mb() -> float:
    """This process's high-water mark of resident memory (``VmHWM``: per address space, so,
    unlike ``ru_maxrss``, not inherited from the parent through fork and exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux


def _rank(rank: int, world_size: int, folder: str, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    if world_size == 1:
        from specray.models.loading import load_model

        model = load_model(folder, device="cpu").model
    else:
        from specray.models.tp import init_process_group_cpu
        from specray.models.tp_loading import load_model_shard

        init_process_group_cpu(rank, world_size, init_method)
        model = load_model_shard(folder, rank, world_size, device=torch.device("cpu")).model
    held = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    with torch.inference_mode():  # weights mapped from the files count once a forward reads them
        for parameter in model.parameters():
            parameter.sum()
    report = {"rank": rank, "peak_rss_mb": _peak_rss_mb(), "parameters_mb": held}
    Path(out_dir, f"tp{world_size}-rank{rank}.json").write_text(json.dumps(report))
    if world_size > 1:
        torch.distributed.destroy_process_group()


def run_tp_memory(config: TpMemoryConfig = TpMemoryConfig()) -> dict:
    with tempfile.TemporaryDirectory(prefix="specray-tp-memory-") as scratch:
        folder = Path(scratch, "model")
        num_parameters = _save_random_model(config, folder)
        rows = {}
        for world_size in (1, 2):
            init_method = f"file://{scratch}/rendezvous-{world_size}"
            mp.spawn(_rank, args=(world_size, str(folder), init_method, scratch), nprocs=world_size)
            rows[world_size] = [
                json.loads(Path(scratch, f"tp{world_size}-rank{rank}.json").read_text())
                for rank in range(world_size)
            ]
    tp1 = rows[1][0]["peak_rss_mb"]
    tp2 = max(rank["peak_rss_mb"] for rank in rows[2])
    return {
        "config": asdict(config),
        "num_parameters": num_parameters,
        "tp1": rows[1],
        "tp2": rows[2],
        "tp2_over_tp1_peak_rss": tp2 / tp1,
    }


def format_report(report: dict) -> str:
    lines = [
        f"random Llama, {report['num_parameters'] / 1e9:.2f}B parameters (float32), "
        "peak RSS per rank while loading:"
    ]
    for key in ("tp1", "tp2"):
        for rank in report[key]:
            lines.append(
                f"  {key.upper()} rank {rank['rank']}: {rank['peak_rss_mb']:.0f} MB peak, "
                f"{rank['parameters_mb']:.0f} MB of parameters held"
            )
    lines.append(f"TP = 2 over TP = 1: {report['tp2_over_tp1_peak_rss']:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(run_tp_memory(), indent=1))
