"""The soak report's arithmetic (tests/chaos/soak.py): growth from the first sample after the
warm-up to the last, per process, and the throughput baseline."""

from tests.chaos.soak import growth, throughput_trend, throughput_windows


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
    # the first window: 8/s for 60 s, 10/s for 60 s, 12/s for 180 s
    assert grown["tokens_per_s_baseline"] == (480 + 600 + 2160) / 300
    assert grown["tokens_per_s_last"] == 9.0 and grown["errors"] == 1
    # the last sample stands for 1620 s: windows 300-600, ..., 1800-2100 hold only it,
    # and it ends in the 1800-2100 window, which therefore holds all of it
    assert grown["tokens_per_s_windows"] == [10.8, 9.0]
    assert grown["tokens_per_s_worst_change"] == round(9.0 / 10.8 - 1, 3)


def test_throughput_windows_weigh_by_time_and_fold_a_short_tail():
    samples = [{"t_s": t, "tokens_per_s": rate} for t, rate in [(150, 10), (300, 20), (450, 30)]]
    assert throughput_windows(samples, 300) == [15.0, 30.0]
    samples.append({"t_s": 500, "tokens_per_s": 90})  # 50 s: under half a window, folded
    assert throughput_windows(samples, 300) == [15.0, (30 * 150 + 90 * 50) / 200]


def test_no_samples_no_growth():
    assert growth({"samples": []}) == {}


def test_the_trend_sees_a_steady_fall_through_noise():
    """A line from 200 to 150 tokens/s over 1500 s (-25 % of its mean, 175) under +-30
    alternating noise; flat noise has no trend."""
    falling = [
        {"t_s": t, "tokens_per_s": 200 - 50 * t / 1500 + (30 if i % 2 else -30)}
        for i, t in enumerate(range(0, 1515, 15))
    ]
    assert abs(throughput_trend(falling) - (-50 / 175)) < 0.01
    flat = [{"t_s": t, "tokens_per_s": 175 + (30 if i % 2 else -30)} for i, t in
            enumerate(range(0, 1515, 15))]  # fmt: skip
    assert abs(throughput_trend(flat)) < 0.01
    assert throughput_trend(flat[:1]) == 0.0
