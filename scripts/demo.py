"""The main job on the embedded default: the bundled SmolLM2-135M-Instruct as target, its own
weights in bf16 as draft, greedy and sampled. Checks what it shows: speculative greedy output is
token-identical to target-only decoding, and a seeded sampled run repeats exactly."""

from __future__ import annotations

import sys
import time

from specray import Engine, SamplingParams

PROMPT = "Explain in three sentences why speculative decoding gives the same output."


def timed_generate(engine: Engine, params: SamplingParams):
    started = time.perf_counter()
    output = engine.generate([PROMPT], params)[0]
    return output, time.perf_counter() - started


def main() -> int:
    print("specray demo: target = bundled SmolLM2-135M-Instruct (GGUF, converted once)")
    target_only = Engine("default", draft=None)
    speculative = Engine("default", draft="default", num_speculative_tokens=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=48)
    reference, reference_s = timed_generate(target_only, greedy)
    output, output_s = timed_generate(speculative, greedy)
    print(f"\nprompt: {PROMPT}\n\nanswer: {output.text}\n")
    tokens = len(output.token_ids)
    print(f"target-only : {tokens / reference_s:6.2f} tokens/s")
    print(
        f"speculative : {tokens / output_s:6.2f} tokens/s (draft=self:bf16, k=8), "
        f"acceptance {output.metrics.acceptance_rate:.2f}, "
        f"mean accepted length {output.metrics.mean_acceptance_length:.2f}"
    )
    identical = output.token_ids == reference.token_ids
    print(f"greedy output identical to target-only: {identical}")

    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=1234)
    first = speculative.generate([PROMPT], sampled)[0]
    again = speculative.generate([PROMPT], sampled)[0]
    repeatable = first.token_ids == again.token_ids
    print(f"\nsampled (T=0.8, top_p=0.95, seed=1234): {first.text}")
    print(f"same seed, same output: {repeatable}")
    if not (identical and repeatable):
        print("demo check FAILED", file=sys.stderr)
        return 1
    print("\ndemo checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
