"""What the coordinator needs from the workers: two small async protocols.

The coordinator's scheduling code is the same whether the workers are Ray actors exchanging
blocks over gRPC (:mod:`specray.cluster.ray_backends`) or simulated workers on a discrete-event
clock (:mod:`specray.sim`). Items and replies are plain data (they cross Ray as is).

Target verify item (one per request of a micro-batch):
    request_id, step, num_committed, expect_draft
    + prompt_token_ids, params, seed, output_token_ids when the target has not seen the request
    + prefill_until (chunked prefill): cache at most this many of the request's context tokens
      (prompt and committed output but the pending token) this call
Target verify reply:
    results: per item {request_id, token_ids, num_draft_tokens, num_accepted, finish_reason,
             dropped_reason}, + prefilling: true (and no tokens) for a request whose context
             is not all cached yet
    wait_s (waited for draft blocks: the pipeline bubble), compute_s (forward + verification),
    service_s (time inside the call)

Draft propose item (requests with k > 0):
    request_id, step, k, num_committed, new_token_ids (committed tokens the draft has not seen)
    + prompt_token_ids, params, seed when the draft worker has not seen the request
Draft propose reply:
    bytes (sent to the target), draft_s (drafting compute), steps (draft forwards),
    reused_tokens (draft-ahead tokens kept), ahead_tokens (drafted ahead in this call)
"""

from __future__ import annotations

from typing import Protocol


def prefilling_result(request_id: str) -> dict:
    """A verify result for a request that only prefilled part of its context this call."""
    return {
        "request_id": request_id,
        "token_ids": [],
        "num_draft_tokens": 0,
        "num_accepted": 0,
        "finish_reason": None,
        "dropped_reason": "",
        "prefilling": True,
    }


class TargetBackend(Protocol):
    async def verify(self, items: list[dict], draft_deadline_s: float) -> dict: ...

    async def release(self, request_ids: list[str]) -> None: ...

    async def ping(self) -> None:
        """A no-op call that never queues behind verification: measures the round trip."""
        ...

    async def held_requests(self) -> list[str]:
        """Requests whose state (KV cache) the target holds: for tests and leak checks."""
        ...


class DraftBackend(Protocol):
    num_workers: int

    def available(self, worker: int) -> bool:
        """True when the worker can take work (False while a replacement starts)."""
        ...

    async def prefill(self, worker: int, items: list[dict]) -> dict:
        """Take on new requests (state and KV cache); they run target-only until it is done."""
        ...

    async def propose(self, worker: int, items: list[dict], draft_ahead: bool) -> dict: ...

    async def release(self, worker: int, request_ids: list[str]) -> None: ...

    async def replace(self, worker: int) -> None:
        """Start a replacement for a failed worker (returns at once; see ``available``)."""
        ...

    async def held_requests(self, worker: int) -> list[str]: ...
