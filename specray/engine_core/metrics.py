"""Prometheus metrics of a coordinator, named as vLLM's so existing dashboards work.

vLLM exports ``vllm:spec_decode_num_drafts_total`` and friends; specray exports the same names
under the ``specray:`` prefix, plus what a distributed speculative decoder adds: target busy
fraction, pipeline bubble time, queue depth, per-phase latency and bytes on the wire. Each
coordinator owns its registry, so several can live in one process (tests, simulations).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # the *_created series double the output and no dashboard reads them

PREFIX = "specray:"
# Seconds: 1 ms .. 30 s, enough resolution for CPU steps (~0.1 s) and GPU steps (~10 ms).
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25,
    0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# Tokens per request (prompt, generation) and per round: vLLM's 1-2-5 steps.
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class CoordinatorMetrics:
    def __init__(self, model_name: str = "default"):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self._labels = {"model_name": model_name}
        self._children: dict[tuple, object] = {}

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets=LATENCY_BUCKETS_S) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        # vLLM's speculative-decoding counters (prometheus_client appends ``_total``).
        self.num_drafts = counter("spec_decode_num_drafts", "Verifications with drafts.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position of the block.",
            ("position",),
        )
        # vLLM's request-level names.
        self.num_requests_running = gauge("num_requests_running", "Requests being decoded.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests in the queue.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("generation_tokens", "Tokens committed.")
        self.request_success = counter(
            "request_success", "Finished requests by reason.", ("finished_reason",)
        )
        self.request_rejected = counter(
            "request_rejected", "Requests refused at admission (queue full)."
        )
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token.")
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between streamed tokens (per token)."
        )
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Request latency.")
        # A finished request's phases: waiting for a batch slot, then until its first token
        # (prefill, chunked or not), then the rest (decode).
        self.request_queue_time = histogram("request_queue_time_seconds", "Time in the queue.")
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "From admission to the first token."
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "From the first token to the last."
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of finished requests.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens of finished requests.", TOKEN_BUCKETS
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Tokens a target round ran (prompts prefilled and verified tokens).",
            TOKEN_BUCKETS,
        )
        self.shared_tokens = counter(
            "shared_tokens",
            "Tokens fed to the target but copied from a row fed the same over the same cache "
            "(the n choices of one prompt prefill it once).",
        )
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc", "Share of the target's allocated KV slots in use (1 = 100%)."
        )
        # specray never preempts (a request keeps its cache rows until it ends): always 0,
        # exported so that dashboards built for vLLM find the series.
        self.num_preemptions = counter("num_preemptions", "Requests preempted (never).")
        self.labels(self.num_preemptions)  # the series exists from the start, at 0
        # Distributed speculation.
        self.target_busy_seconds = counter("target_busy_seconds", "Target compute time.")
        self.pipeline_bubble_seconds = counter(
            "pipeline_bubble_seconds", "Target time spent waiting for draft blocks."
        )
        self.target_busy_fraction = gauge(
            "target_busy_fraction", "Target compute time / wall time since the last reset."
        )
        self.draft_latency = histogram("draft_latency_seconds", "Draft worker time per call.")
        self.network_latency = histogram(
            "network_latency_seconds", "Round trip of a no-op call to the target group."
        )
        self.verify_latency = histogram("verify_latency_seconds", "Target verification compute.")
        self.wire_bytes = counter("draft_wire_bytes", "Draft block bytes sent draft -> target.")
        self.dropped_blocks = counter(
            "dropped_draft_blocks", "Blocks dropped before verification, by reason.", ("reason",)
        )
        self.draft_worker_restarts = counter("draft_worker_restarts", "Draft workers replaced.")

    def labels(self, metric, **extra):
        """The metric's child for this model (and ``extra`` labels), looked up once."""
        key = (id(metric), *extra.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self._labels, **extra)
        return child

    def record_round(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.labels(self.num_drafts).inc()
        self.labels(self.num_draft_tokens).inc(num_draft_tokens)
        self.labels(self.num_accepted_tokens).inc(num_accepted)
        for position in range(num_accepted):
            self.labels(self.accepted_per_pos, position=str(position)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition format (what ``GET /metrics`` serves)."""
        return generate_latest(self.registry)


def merge_expositions(texts: dict[str, bytes], label: str = "replica") -> bytes:
    """One exposition from several coordinators' (``{replica id: render()}``): every sample
    gains ``label=<replica id>``, so each series stays its own and sums are a query away."""
    from prometheus_client.core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for source, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text.decode()):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, label: source}, sample.value)

    class _Snapshot:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot())
    return generate_latest(registry)
