"""A front end's session on the engine core's loop (``engine_core/sessions.py``): the messages
its reading thread hands over are taken in the order sent, however many arrive in one turn of
the loop, and the front end's going away comes after them. A real coordinator over a simulated
target, on the simulator's virtual clock."""

from __future__ import annotations

import asyncio
import random

import pytest

from specray.engine_core.coordinator import Coordinator, CoordinatorConfig
from specray.engine_core.policy import DraftCost, VerifyCost
from specray.engine_core.sessions import Session
from specray.protocol import DeltaBatch, FrontendBatch, Submit, decode
from specray.sampling import SamplingParams
from specray.sim import AcceptanceModel, LatencyModel, run_virtual
from specray.sim.workers import SimInbox, SimTargetBackend

pytestmark = pytest.mark.unit
VOCAB = 64
LATENCY = LatencyModel(
    verify=VerifyCost(fixed_s=0.02, per_request_s=0.0, per_token_s=0.0),
    draft_step=DraftCost(fixed_s=0.005, per_request_s=0.0),
    rtt_s=0.002,
    coordinator_overhead_s=0.0,
)


def _submit(request_id: str, max_tokens: int = 6) -> FrontendBatch:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return FrontendBatch(submits=(Submit(request_id, (5, 6, 7), params),))


async def _session_run(messages: list[FrontendBatch | None], settle_s: float = 1.0):
    """Hand ``messages`` to a session in one turn of the loop, as a burst from its reading
    thread; the deltas it sent back (request id -> tokens, finish reason or error type), what
    the target still holds and whether the session still names requests."""
    target = SimTargetBackend(LATENCY, AcceptanceModel((0.5,)), SimInbox(), random.Random(0))
    coordinator = Coordinator(
        target, None, CoordinatorConfig(num_speculative_tokens=0), vocab_size=VOCAB
    )
    await coordinator.start()
    sent: list[DeltaBatch] = []
    session = Session(coordinator, asyncio.get_running_loop(), lambda p: sent.append(p))
    for message in messages:
        session.receive(message)
    await asyncio.sleep(settle_s)
    await coordinator.stop()
    ends, tokens = {}, {}
    for payload in sent:
        for delta in decode(payload, DeltaBatch).deltas:
            tokens[delta.request_id] = tokens.get(delta.request_id, ()) + delta.token_ids
            if delta.finished is not None:
                ends[delta.request_id] = delta.finished.finish_reason
            elif delta.error is not None:
                ends[delta.request_id] = delta.error.type
    return tokens, ends, await target.held_requests(), session.requests


def test_a_burst_of_messages_is_taken_in_the_order_sent():
    """``a``'s abort right behind its submission cancels it, whatever else came between; ``b``
    runs to its length. Taken out of order, the abort would find nothing and ``a`` would run."""
    messages = [_submit("a"), _submit("b", max_tokens=4), FrontendBatch(aborts=("a",))]
    tokens, ends, held, named = run_virtual(_session_run(messages))
    assert ends == {"a": "cancelled_error", "b": "length"}
    assert len(tokens["b"]) == 4 and not tokens.get("a")
    assert held == [] and not named


def test_the_front_end_going_away_comes_after_what_it_sent():
    """The reading thread's last hand-over (None) closes the session after the submission it
    read before: the request is aborted, not left running for no one."""
    tokens, ends, held, named = run_virtual(_session_run([_submit("c", max_tokens=50), None]))
    assert not tokens.get("c") and held == [] and not named
    # Control: the same submission with the front end still there runs to its length.
    tokens, ends, held, named = run_virtual(_session_run([_submit("c", max_tokens=50)], 5.0))
    assert ends == {"c": "length"} and len(tokens["c"]) == 50 and held == []
