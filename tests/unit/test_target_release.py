"""The target worker frees the requests a round ended in one release: freeing a cache row
compacts the rows after it, so one release per ended request would move the rows behind it
once for each. The rows that stay must keep their caches: a survivor's greedy tokens equal
those it gets alone (the control for the compaction)."""

import pytest

from specray.actors.target_worker import TargetWorker
from specray.models.tiny import save_tiny_model
from specray.protocol import RequestSpec, VerifyItem, VerifyRound
from specray.sampling import SamplingParams

PROMPTS = {
    "a": (5, 17, 33, 8),
    "b": (9, 2, 41),
    "c": (12, 12, 7, 30, 3),
    "long": (4, 28, 19, 6, 11, 2),
}


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny"))
    made = TargetWorker(folder, rank=0, world_size=1, init_method="", verifier_host="127.0.0.1")
    yield made
    made.stop()


def spec(request_id: str, max_tokens: int) -> RequestSpec:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return RequestSpec(request_id, PROMPTS[request_id], params, seed=0)


def run(worker, specs: list[RequestSpec]) -> dict[str, list[int]]:
    """Rounds until every request ended (target only, one token a round); tokens by id."""
    tokens = {s.request_id: [] for s in specs}
    live, step = {s.request_id: s for s in specs}, 0
    while live:
        items = tuple(
            VerifyItem(rid, step, len(tokens[rid]), False, spec=s if step == 0 else None)
            for rid, s in live.items()
        )
        report = worker.verify_round(VerifyRound(items, draft_deadline_s=0.1))
        for result in report.results:
            tokens[result.request_id] += result.token_ids
            if result.finish_reason:
                del live[result.request_id]
        step += 1
    return tokens


def test_a_round_that_ends_requests_frees_them_in_one_release(worker, monkeypatch):
    alone = run(worker, [spec("long", 4)])["long"]
    removed = []
    remove = worker.runner.remove

    def counted(seq_ids):
        removed.append(sorted(seq_ids))
        remove(seq_ids)

    monkeypatch.setattr(worker.runner, "remove", counted)
    # "a", "b", "c" end in the first round, in front of "long" in the cache's rows.
    together = run(worker, [spec("a", 1), spec("b", 1), spec("c", 1), spec("long", 4)])
    assert removed == [["a", "b", "c"], ["long"]]
    assert together["long"] == alone
    assert worker.held_requests() == []
