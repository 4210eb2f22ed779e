"""One check of the GPU data plane, ready to run on a GPU machine: ``scripts/gpu-check``.

It needs torch, transformers, scipy and this repository only (no Ray, no network, no model
files): every model is made on the spot with random weights. Six parts, one JSON report:

1. **Greedy identity** under the GPU contract (:mod:`specray.sampling.greedy_contract`): a
   random target in the device's default dtype and a perturbed draft; speculative greedy
   output against target-only greedy output, partings allowed only at near-ties.
2. **Sequence distribution**: 2000 seeded generations (temperature 1, k = 2, 3 tokens) of a
   tiny random pair through the device path against the target's exact distribution by
   enumeration; Pearson chi-square at alpha = 0.001 (cells expected below 5 pooled). Negative
   control: the draft's own target-only generations against the same oracle must be rejected.
3. **Speed**: target-only against speculative decoding with draft == target (every draft
   accepted), tokens per second at batch 1.
4. **Step costs** of realistic shapes with random weights: a Llama-3-8B-shaped target (bf16 on
   CUDA) verifying k + 1 = 1..9 tokens and a Llama-3.2-1B-shaped draft's step, at batch 1, 8
   and 64, written as the ``latency`` section of a ``specray simulate`` config.
5. **Batch invariance** (reported, not a pass condition: it is shown for the CPU's kernels
   only): the largest difference between a token's logits decoded one at a time and fed in
   blocks of 5 beside two other sequences, for the batch-invariant runner and the default one.

6. **Mixed rounds** (reported): 15 rows decoding beside a new prompt in one target forward,
   packed (:mod:`specray.models.packing`) against padded to the prompt: milliseconds and the
   largest logit difference between the two.

``--quick`` shrinks every shape (the CPU smoke test in ``make test``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass

import torch

from specray.engine import Engine
from specray.engine_core.policy import tabulate
from specray.models.device import DeviceTimer, default_dtype, resolve_device
from specray.models.random_models import exact_sequence_probs, perturbed_copy, tiny_llama
from specray.models.runner import ModelRunner
from specray.sampling import SamplingParams
from specray.sampling.greedy_contract import compare_greedy

ALPHA = 1e-3  # significance level of the chi-square test and its negative control
NUM_SAMPLES = 2000  # seeded generations (seeds 0..N-1) for the distribution test
MIN_EXPECTED = 5.0  # chi-square cells expected below this are pooled
BATCHES = (1, 8, 64)
VERIFY_TOKENS = tuple(range(1, 10))  # a decode step (1) and verifications of k + 1 = 2..9


def _shape(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int) -> dict:
    return {
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
    }


SHAPES = {  # name -> LlamaConfig fields
    "llama-3-8b": _shape(4096, 14336, 32, 32, 8, 128256),
    "llama-3.2-1b": _shape(2048, 8192, 16, 32, 8, 128256),
    "quick-target": _shape(64, 128, 2, 4, 2, 512),
    "quick-draft": _shape(32, 64, 1, 2, 1, 512),
}


@dataclass(frozen=True)
class GpuCheckConfig:
    device: str = "cuda"
    quick: bool = False
    context: int = 512  # cached tokens per sequence when timing steps
    seed: int = 0


def random_llama(shape: str, device: torch.device, dtype: torch.dtype, seed: int):
    """A Llama of a named shape with random weights made on ``device`` (no host copy)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.normal_(std=0.02, generator=generator)
        # buffers were created empty on the meta device: the rotary frequencies again
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config).to(device)
    return model.eval()


def _environment(device: torch.device) -> dict:
    info = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info |= {"name": properties.name, "memory_gib": properties.total_memory / 2**30}
    return info


def _greedy_identity(device: torch.device, dtype: torch.dtype, config: GpuCheckConfig) -> dict:
    shape = "quick-target" if config.quick else "llama-3.2-1b"
    target = random_llama(shape, device, dtype, config.seed)
    draft = perturbed_copy(target, seed=config.seed + 1, noise=0.05)
    rng = random.Random(config.seed)
    vocab = SHAPES[shape]["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(8)] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    speculative = Engine(target=target, draft=draft, num_speculative_tokens=4, device=str(device))
    reference = Engine(target=target, draft=None, device=str(device))
    spec_out = speculative.generate(prompts, params)
    ref_out = reference.generate(prompts, params)
    runner = ModelRunner(target, tune=False)
    rows = []
    for i, (prompt, spec, ref) in enumerate(zip(prompts, spec_out, ref_out, strict=True)):
        feed = [*prompt, *ref.token_ids[:-1]]
        logits = runner.forward({i: feed}, {i: len(ref.token_ids)})[i]
        runner.remove([i])
        rows.append(compare_greedy(spec.token_ids, ref.token_ids, logits, dtype))
    return {
        "shape": shape,
        "dtype": str(dtype),
        "prompts": len(prompts),
        "identical": sum(row.parted_at is None for row in rows),
        "parted_at_near_ties": sum(row.parted_at is not None and row.holds for row in rows),
        "violations": [row.__dict__ for row in rows if not row.holds],
        "acceptance_rate": sum(o.metrics.acceptance_rate for o in spec_out) / len(spec_out),
        "passed": all(row.holds for row in rows),
    }


def _chi_square(counts: Counter, exact: dict) -> dict:
    import scipy.stats

    observed, expected, pooled_o, pooled_e = [], [], 0, 0.0
    total = sum(counts.values())
    impossible = sum(n for seq, n in counts.items() if exact.get(seq, 0.0) == 0.0)
    for sequence, probability in exact.items():
        if probability * total < MIN_EXPECTED:
            pooled_o, pooled_e = pooled_o + counts.get(sequence, 0), pooled_e + probability * total
        else:
            observed.append(counts.get(sequence, 0))
            expected.append(probability * total)
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    scale = sum(observed) / sum(expected)  # float rounding of the exact probabilities
    statistic, p_value = scipy.stats.chisquare(observed, [e * scale for e in expected])
    return {"cells": len(observed), "statistic": float(statistic), "p_value": float(p_value),
            "impossible_sequences_seen": impossible}  # fmt: skip


def _distribution(device: torch.device, config: GpuCheckConfig) -> dict:
    """float32 on every device: the oracle and the engine then read the same model."""
    target = tiny_llama(5, seed=0).to(device)
    draft = perturbed_copy(target, seed=1, noise=0.5)
    prompt, length = [0, 3, 1], 3
    params = [SamplingParams(temperature=1.0, max_tokens=length, ignore_eos=True, seed=i)
              for i in range(NUM_SAMPLES)]  # fmt: skip
    exact = exact_sequence_probs(target, prompt, params[0], length)

    def sample(engine: Engine) -> Counter:
        outputs = engine.generate([prompt] * NUM_SAMPLES, params)
        return Counter(tuple(output.token_ids) for output in outputs)

    speculative = Engine(target=target, draft=draft, num_speculative_tokens=2,
                         max_batch_size=NUM_SAMPLES, device=str(device))  # fmt: skip
    wrong = Engine(target=draft, draft=None, max_batch_size=NUM_SAMPLES, device=str(device))
    test, control = _chi_square(sample(speculative), exact), _chi_square(sample(wrong), exact)
    return {
        "samples": NUM_SAMPLES,
        "alpha": ALPHA,
        "seeds": f"0..{NUM_SAMPLES - 1}",
        "speculative": test,
        "negative_control": control,
        "passed": test["p_value"] >= ALPHA
        and test["impossible_sequences_seen"] == 0
        and control["p_value"] < ALPHA,
    }


def _speed(device: torch.device, dtype: torch.dtype, config: GpuCheckConfig) -> dict:
    shape = "quick-target" if config.quick else "llama-3.2-1b"
    target = random_llama(shape, device, dtype, config.seed)
    prompt = list(range(1, 17))
    params = SamplingParams(temperature=0, max_tokens=16 if config.quick else 128, ignore_eos=True)
    rows = {}
    for name, engine in (
        ("target_only", Engine(target=target, draft=None, device=str(device))),
        ("speculative_k4", Engine(target=target, draft=target, num_speculative_tokens=4,
                                  device=str(device))),
    ):  # fmt: skip
        engine.generate([prompt], params)  # warm-up
        started = time.perf_counter()
        (output,) = engine.generate([prompt], params)
        rows[name] = len(output.token_ids) / (time.perf_counter() - started)
    return {"shape": shape, "tokens_per_s": rows,
            "speedup": rows["speculative_k4"] / rows["target_only"]}  # fmt: skip


def _step_costs(device: torch.device, dtype: torch.dtype, config: GpuCheckConfig) -> dict:
    shapes = ("quick-target", "quick-draft") if config.quick else ("llama-3-8b", "llama-3.2-1b")
    context = 32 if config.quick else config.context
    target = ModelRunner(random_llama(shapes[0], device, dtype, config.seed), tune=False)
    verify = [(batch, tokens, target.time_forward(batch, tokens, context=context))
              for batch in BATCHES for tokens in VERIFY_TOKENS]  # fmt: skip
    del target
    draft = ModelRunner(random_llama(shapes[1], device, dtype, config.seed + 1), tune=False)
    draft_steps = [(batch, draft.time_forward(batch, 1, context=context)) for batch in BATCHES]
    return {
        "target_shape": shapes[0],
        "draft_shape": shapes[1],
        "dtype": str(dtype),
        "context": context,
        "verify_s": [list(row) for row in verify],
        "draft_step_s": [list(row) for row in draft_steps],
        "simulate_latency": {  # paste under `latency:` in a specray simulate config
            "verify": {"table": [list(p) for p in tabulate([(b * t, s) for b, t, s in verify])]},
            "draft_step": {"table": [list(p) for p in tabulate(draft_steps)]},
        },
    }


def fed_logits(runner: ModelRunner, prompt: list[int], fed: list[int], chunk: int, others: bool):
    """``[len(fed), vocab]``: the logits after each token of ``fed`` (following ``prompt``),
    ``chunk`` tokens a forward; with ``others``, two other sequences in every forward (one of
    130 cached tokens, one fed 9 tokens at a time)."""
    runner.forward({"a": prompt[:-1]}, {})
    if others:
        runner.forward({"long": list(range(200, 330)), "wide": [3, 4]}, {})
    feed, rows = [prompt[-1], *fed], []
    for start in range(0, len(fed), chunk):
        tokens = feed[start : min(start + chunk, len(fed))]
        feeds = {"a": tokens, **({"long": [7], "wide": list(range(9))} if others else {})}
        rows.append(runner.forward(feeds, {"a": len(tokens)})["a"])
    runner.remove(["a", "long", "wide"])
    return torch.cat(rows)


@torch.inference_mode()
def _batch_invariance(device: torch.device, dtype: torch.dtype, config: GpuCheckConfig) -> dict:
    shape = "quick-target" if config.quick else "llama-3.2-1b"
    rng = random.Random(config.seed)
    prompt = [rng.randrange(SHAPES[shape]["vocab_size"]) for _ in range(40)]
    fed = [rng.randrange(SHAPES[shape]["vocab_size"]) for _ in range(20)]
    report = {"shape": shape, "dtype": str(dtype)}
    for name, invariant in (("batch_invariant", True), ("default", False)):
        model = random_llama(shape, device, dtype, config.seed)
        runner = ModelRunner(model, tune=False, batch_invariant=invariant)
        alone = fed_logits(runner, prompt, fed, 1, others=False)
        mixed = fed_logits(runner, prompt, fed, 5, others=True)
        report[f"{name}_max_abs"] = float((alone - mixed).abs().max())
    return report


@torch.inference_mode()
def _mixed_round(device: torch.device, dtype: torch.dtype, config: GpuCheckConfig) -> dict:
    shape = "quick-target" if config.quick else "llama-3-8b"
    length, context = (16, 32) if config.quick else (512, config.context)
    rng = random.Random(config.seed)
    vocab = SHAPES[shape]["vocab_size"]
    contexts = {f"row-{r}": [rng.randrange(vocab) for _ in range(context)] for r in range(15)}
    feeds = {seq_id: [rng.randrange(vocab)] for seq_id in contexts}
    feeds["new"] = [rng.randrange(vocab) for _ in range(length)]
    model = random_llama(shape, device, dtype, config.seed)
    report = {"shape": shape, "dtype": str(dtype), "rows": 16, "prompt": length}
    logits = {}
    for name, pack in (("packed", True), ("padded", False)):
        runner = ModelRunner(model, tune=False, pack=pack)
        runner.forward(contexts, {})
        best = float("inf")
        for _ in range(3):
            timer = DeviceTimer(device).start()
            logits[name] = runner.forward(feeds, dict.fromkeys(feeds, 1))
            best = min(best, timer.stop().seconds())
            for seq_id, feed in feeds.items():
                runner.rollback(seq_id, len(feed))
        report[f"{name}_ms"] = 1e3 * best
        del runner
    report["padded_over_packed"] = report["padded_ms"] / report["packed_ms"]
    report["max_abs_logit_difference"] = max(
        float((logits["packed"][s] - logits["padded"][s]).abs().max()) for s in feeds
    )
    return report


def run_gpu_check(config: GpuCheckConfig) -> dict:
    device = resolve_device(config.device)
    dtype = getattr(torch, default_dtype(device))
    torch.manual_seed(config.seed)
    report = {"config": config.__dict__, "environment": _environment(device)}
    started = time.perf_counter()
    for name, part in (
        ("greedy_identity", lambda: _greedy_identity(device, dtype, config)),
        ("distribution", lambda: _distribution(device, config)),
        ("speed", lambda: _speed(device, dtype, config)),
        ("step_costs", lambda: _step_costs(device, dtype, config)),
        ("batch_invariance", lambda: _batch_invariance(device, dtype, config)),
        ("mixed_round", lambda: _mixed_round(device, dtype, config)),
    ):
        part_started = time.perf_counter()
        report[name] = part() | {"seconds": time.perf_counter() - part_started}
        print(f"gpu-check: {name} done", file=sys.stderr, flush=True)
    report["seconds"] = time.perf_counter() - started
    report["passed"] = report["greedy_identity"]["passed"] and report["distribution"]["passed"]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes (the CPU smoke test)")
    args = parser.parse_args(argv)
    report = run_gpu_check(GpuCheckConfig(device=args.device, quick=args.quick))
    print(json.dumps(report, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
