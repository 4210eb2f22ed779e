"""The engine core beside the target: per round, no Ray call, at most one message each way per
draft worker and one delta batch per front end, whatever the batch size; requests whose caller
waits for the whole output cost their front end a few messages, not one per round."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import ray

from specray import SamplingParams
from specray.cluster.distributed import DistributedBackend
from specray.engine_core.client import EngineCoreClient
from specray.engine_core.coordinator import CoordinatorConfig

# A fixed block of 2 every round (adaptive k off), one micro-batch, draft-ahead on: every round
# after a request's first drafts, so every round needs its draft worker.
CONFIG = CoordinatorConfig(
    max_running=16,
    num_micro_batches=1,
    num_speculative_tokens=2,
    adaptive_k=False,
    draft_ahead=True,
    draft_deadline_s=5.0,
)
LENGTH = 48  # tokens per request (ignore_eos)
# Rounds that are not steady: a request's first (prefill; the draft is handed it), its last
# (released), and a spare for the draft's prefill reply arriving on its own.
UNSTEADY_MESSAGES = 4


@pytest.fixture(scope="module", params=["workers", "colocated"])
def backend(request, cluster, tiny_pair):
    """The draft as an actor on the draft node (its own stream), or inside rank 0's process
    (the same messages in memory): the same counts either way."""
    backend = DistributedBackend(tiny_pair[1], tiny_pair[2], draft_placement=request.param)
    yield backend
    backend.shutdown()


def _draft_stats(backend: DistributedBackend) -> dict:
    if backend.colocated:
        return ray.get(backend.leader.draft_stats.remote())
    return ray.get(backend.drafts[0].stats.remote())


def _draft_received(backend, before: dict, sent: int, timeout_s: float = 10.0) -> tuple[dict, int]:
    """(the draft's stats once it has read the ``sent`` messages the engine core sent it since
    ``before``, how many reads that took): it reads them on a thread of its own, so the last
    may still be on its way when the engine core stops."""
    deadline = time.monotonic() + timeout_s
    reads = 0
    while True:
        after, reads = _draft_stats(backend), reads + 1
        delivered = after["messages_received"] - before["messages_received"] >= sent
        if delivered or time.monotonic() > deadline:  # (the counts' assertion says what is not)
            return after, reads
        time.sleep(0.05)


def _counts(backend: DistributedBackend, batch: int, *, stream: bool = True) -> dict:
    """Run ``batch`` requests together (same length: they start and end in the same rounds)
    through a fresh engine core and one session; return the round and message counts."""
    draft_before = _draft_stats(backend)
    client = EngineCoreClient(backend.start_engine(CONFIG))
    try:
        params = [
            SamplingParams(temperature=1.0, max_tokens=LENGTH, ignore_eos=True, seed=i)
            for i in range(batch)
        ]
        core_before = backend.engine_stats()
        started = time.monotonic()
        streams = client.submit_many([([1, 2, 3], p, {"stream": stream}) for p in params])
        outputs = [s.result() for s in streams]
        elapsed_s = time.monotonic() - started
        core = backend.engine_stats()
        batches_received = client.batches_received
    finally:
        client.close()
        ray.get(backend.leader.stop_engine_core.remote(drain=True))
    draft_after, reads = _draft_received(backend, draft_before, core["pool"]["messages_sent"])
    assert all(len(output.token_ids) == LENGTH for output in outputs)
    assert sum(output.metrics.num_draft_tokens for output in outputs) > 0
    return {
        "rounds": core["stats"]["rounds"],
        "down": core["pool"]["messages_sent"],
        "up": core["pool"]["messages_received"],
        "draft_down": draft_after["messages_received"] - draft_before["messages_received"],
        "deltas_sent": core["sessions"],
        "deltas_received": batches_received,
        "elapsed_s": elapsed_s,
        # Ray calls that reached the workers meanwhile, by method (the snapshots' own included)
        "ray_target": dict(Counter(core["ray_calls"]) - Counter(core_before["ray_calls"])),
        "ray_draft": _per_round_calls(draft_before["ray_calls"], draft_after["ray_calls"]),
        "stats_reads": reads,
    }


def _per_round_calls(before: dict, after: dict) -> dict:
    """Calls between two snapshots by method, less ``lifeline``: the backend's watcher makes
    that never-returning call once per draft actor, from its own thread, which may start it
    after the first snapshot on a loaded machine (seen once, after other tests)."""
    counts = Counter(after) - Counter(before)
    counts.pop("lifeline", None)
    return dict(counts)


@pytest.mark.parametrize("batch", [1, 8])
def test_a_round_is_one_message_each_way_and_no_ray_call(backend, batch):
    counts = _counts(backend, batch)
    print(f"batch {batch}: {counts}")
    rounds = counts["rounds"]
    # Every round after the first speculates: one round commits at most k + 1 = 3 tokens.
    assert rounds >= LENGTH // 3
    # Ray is off the round path: only this test's own snapshots reached the workers through it.
    assert counts["ray_target"] == {"engine_core_stats": 1}
    # (a colocated draft is no actor: its counters are read through the target's)
    assert counts["ray_draft"] == ({} if backend.colocated else {"stats": counts["stats_reads"]})
    # The draft worker: one command (with the verdicts) in, one block message (with the report
    # on the previous command) out per round, however many requests the round holds.
    assert counts["down"] <= rounds + UNSTEADY_MESSAGES
    assert counts["draft_down"] == counts["down"]
    assert rounds - UNSTEADY_MESSAGES <= counts["up"] <= rounds + UNSTEADY_MESSAGES
    # The front end: one delta batch per round (every request's new tokens), plus the ends.
    assert counts["deltas_sent"] == counts["deltas_received"]
    assert counts["deltas_sent"] <= rounds + 1


def test_unstreamed_requests_send_first_tokens_progress_and_end(backend):
    """``stream=False`` (what ``Engine.generate`` and non-streamed API calls send): the session
    sends the first tokens (the front end's sign of admission), progress at most every
    PROGRESS_INTERVAL_S and the end, not a message per round; the outputs are whole."""
    from specray.engine_core.sessions import PROGRESS_INTERVAL_S

    batch = 4
    counts = _counts(backend, batch, stream=False)
    print(f"unstreamed: {counts}")
    assert counts["rounds"] >= LENGTH // 3
    assert counts["deltas_sent"] == counts["deltas_received"]
    # Each request's first tokens and its end (requests admitted between two rounds start and
    # end a round apart), and the progress reports: far fewer than a message per round.
    progress = counts["elapsed_s"] / PROGRESS_INTERVAL_S + 1
    assert counts["deltas_sent"] <= 2 * batch + progress
    assert counts["deltas_sent"] < counts["rounds"]


def test_an_unstreamed_request_is_not_woken_by_a_streamed_neighbour(backend):
    """A streamed request beside an unstreamed one makes the session send a delta batch every
    round; the unstreamed request's tokens stay out of them but for its first tokens, its
    progress reports and its end (its front end would wake it for nothing), and its output
    is whole."""
    from specray.engine_core.sessions import PROGRESS_INTERVAL_S

    client = EngineCoreClient(backend.start_engine(CONFIG))
    params = SamplingParams(temperature=1.0, max_tokens=LENGTH, ignore_eos=True, seed=3)
    try:
        started = time.monotonic()
        streamed, whole = client.submit_many(
            [([1, 2, 3], params, {"stream": True}), ([1, 2, 3], params, {"stream": False})]
        )
        streamed_deltas, whole_deltas = list(streamed), list(whole)
        elapsed_s = time.monotonic() - started
        rounds = backend.engine_stats()["stats"]["rounds"]
    finally:
        client.close()
        ray.get(backend.leader.stop_engine_core.remote(drain=True))
    print(f"rounds {rounds}: streamed {len(streamed_deltas)}, whole {len(whole_deltas)}")
    assert len(streamed_deltas) >= LENGTH // 3  # a delta each round (k = 2: 3 tokens at most)
    assert len(whole_deltas) <= 2 + elapsed_s / PROGRESS_INTERVAL_S + 1
    assert len(whole.result().token_ids) == LENGTH
