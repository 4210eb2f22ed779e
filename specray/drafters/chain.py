"""``"ngram+<model>"``: prompt lookup first, a draft model for requests it finds nothing for.

Each block comes whole from one drafter with that drafter's exact q (a point mass for n-gram,
the model's distribution otherwise), so verification is exact whichever proposed it. The model
drafter re-synchronises its KV cache with the committed tokens on its next call, so rounds it
sat out cost nothing but that catch-up.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from specray.drafters.base import DraftBlock, DraftRequest


class FirstFoundDrafter:
    def __init__(self, first, then):
        self.first, self.then = first, then
        self.vocab_size = then.vocab_size
        self.shares_target_architecture = getattr(then, "shares_target_architecture", False)
        self.runner = getattr(then, "runner", None)  # the model part (benchmarks read it)

    def import_prefill(self, target_runner, requests: Sequence[DraftRequest]) -> None:
        self.then.import_prefill(target_runner, requests)

    def prefill(self, requests: Sequence[DraftRequest], source=None) -> None:
        prefill = getattr(self.then, "prefill", None)
        if prefill is not None:
            prefill(requests, source)

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftBlock]:
        blocks = self.first.propose(requests)
        missing = [index for index, block in enumerate(blocks) if not block.token_ids]
        if missing:
            fallback = self.then.propose([requests[index] for index in missing])
            for index, block in zip(missing, fallback, strict=True):
                blocks[index] = block
        return blocks

    def release(self, request_ids: Sequence[Hashable]) -> None:
        self.first.release(request_ids)
        self.then.release(request_ids)
