"""``specray bench --serving``: its config names a bad field, and its report reads as the
figures it holds (a full run needs the served app: docs/bench/served-speedup-*.json)."""

import pytest

from specray.bench.served_speedup import ServedSpeedupConfig, chat_prompts, format_served_speedup


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("repeats", 0),
        ("num_threads", True),
        ("fixed_ks", ()),
        ("fixed_ks", (0,)),
    ],
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ServedSpeedupConfig(**{field: value})


def test_the_workload_is_the_shipped_chat_prompts():
    prompts = chat_prompts()
    assert len(prompts) == 8 and chat_prompts(3) == prompts[:3]


def test_the_report_reads_its_figures():
    row = {"tokens": 96, "seconds": 4.0, "tokens_per_s": 24.0, "drafted": 10, "accepted": 5}
    report = {
        "config": {"max_tokens": 48, "num_threads": 1},
        "prompts": 2,
        "in_process": {"0": row | {"tokens_per_s": 16.0}, "2": row},
        "in_process_best_k": 2,
        "in_process_speedup": 1.5,
        "served": {
            "draft_placement": "colocated",
            "bad_request": {"tokens": 48, "drafted": 20, "accepted": 2},
            "policy": row | {"tokens_per_s": 21.0},
            "off": row | {"tokens_per_s": 15.0},
            "fixed": {"2": row | {"tokens_per_s": 22.5}},
        },
        "served_speedup": 1.4,
        "served_over_in_process": 0.9333,
        "served_best_fixed_k": 2,
        "served_best_fixed_speedup": 1.5,
        "served_fixed_over_in_process": 1.0,
        "policy_over_served_best_fixed": 0.9333,
    }
    text = format_served_speedup(report)
    assert "ratio 0.933 (goal >= 0.9)" in text
    assert "served (draft colocated): bad request first (2/20 drafted accepted)" in text
    assert "on, k=2" in text and "22.50 tok/s" in text
    assert "served best fixed k=2: 1.500x (1.000 of in process); the policy 0.933 of it" in text
