"""The soak report's arithmetic (tests/chaos/soak.py): growth from the first sample after the
warm-up to the last, per process, and the throughput baseline."""

from tests.chaos.soak import growth


def _sample(t_s, processes, tokens_per_s=10.0, errors=0):
    return {
        "t_s": t_s,
        "rss_mb": round(sum(processes.values()), 1),
        "tokens_per_s": tokens_per_s,
        "errors": errors,
        "processes": processes,
    }


def test_growth_counts_from_the_warm_up_and_per_process():
    samples = [
        _sample(60, {"a[1]": 100.0, "b[2]": 50.0}, tokens_per_s=8.0),
        _sample(120, {"a[1]": 110.0, "b[2]": 50.0}, tokens_per_s=10.0),
        _sample(300, {"a[1]": 115.0, "b[2]": 52.0, "c[3]": 9.0}, tokens_per_s=12.0),
        _sample(1920, {"a[1]": 150.0, "b[2]": 49.0, "c[3]": 9.0}, tokens_per_s=9.0, errors=1),
    ]
    grown = growth({"samples": samples})
    assert grown["from_t_s"] == 120 and grown["to_t_s"] == 1920
    assert grown["rss_growth_mb"] == 208.0 - 160.0
    assert grown["mb_per_hour"] == 96.0  # 48 MB over 1800 s
    # c started after the warm-up sample: not compared; the largest growth first
    assert grown["per_process_growth_mb"] == {"a[1]": 40.0, "b[2]": -1.0}
    assert grown["tokens_per_s_baseline"] == 10.0  # samples up to 300 s
    assert grown["tokens_per_s_last"] == 9.0 and grown["errors"] == 1


def test_no_samples_no_growth():
    assert growth({"samples": []}) == {}
