"""Several coordinators' metrics as one exposition (``GET /metrics`` with several target
groups): real coordinator registries in, one valid Prometheus text out, series kept apart."""

from prometheus_client.parser import text_string_to_metric_families

from specray.engine_core.metrics import CoordinatorMetrics, merge_expositions


def test_merged_exposition_keeps_each_replica_and_every_family_once():
    first, second = CoordinatorMetrics("m"), CoordinatorMetrics("m")
    first.labels(first.generation_tokens).inc(3)
    second.labels(second.generation_tokens).inc(5)
    first.record_round(4, 2)
    second.labels(second.verify_latency).observe(0.2)
    text = merge_expositions({"a": first.render(), "b": second.render()})

    lines = text.decode().splitlines()
    type_lines = [line for line in lines if line.startswith("# TYPE ")]
    assert len(type_lines) == len(set(type_lines))  # one TYPE per family
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    tokens = {
        s.labels["replica"]: s.value
        for s in families["specray:generation_tokens"].samples
        if s.name.endswith("_total")
    }
    assert tokens == {"a": 3.0, "b": 5.0}
    drafts = families["specray:spec_decode_num_draft_tokens"].samples
    assert {s.labels["replica"]: s.value for s in drafts} == {"a": 4.0}  # b drafted nothing
    counts = [
        s for s in families["specray:verify_latency_seconds"].samples if s.name.endswith("_count")
    ]
    assert {s.labels["replica"]: s.value for s in counts}["b"] == 1.0
    assert all(s.labels["model_name"] == "m" for f in families.values() for s in f.samples)
