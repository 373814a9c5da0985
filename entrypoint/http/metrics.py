"""Prometheus metrics of the HTTP front (`GET /metrics`), in a registry of their own per app.

Requests by endpoint and status, errors by cause (`code`), generation requests per API key name,
the prefix-cache hit rate, the entrypoint's phase histograms (queue, prefill with the KV transfer,
first decode chunk), time to first token, inter-token latency, tokens in and out,
cached prompt tokens, requests in flight here, and, gathered at scrape time, the cluster's view from
the entrypoint's Health (requests in flight there, healthy instances per stage) and, when the
balancer addresses are configured, each stage instance's stats (`deepinfer_stage_*{stage,instance}`:
KV blocks, requests, KV transfer bytes, preemptions, prefix-cache hit rate; the latency histograms
`deepinfer_stage_latency_seconds{phase}` of queue, prefill, engine step and KV transfer; errors by cause
`deepinfer_stage_errors_total{cause}`; the KV store's figures, `deepinfer_stage_kvstore_*`, per traffic class
`deepinfer_stage_kvstore_class_*{stage,instance,traffic_class}`), read from the instance's Health.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from deepinfer.kvstore.metrics import CLASS_STATS as KVSTORE_CLASS_STATS
from deepinfer.kvstore.metrics import HEALTH_STATS as KVSTORE_STATS

STAGE_STATS = {
    "num_kv_blocks_used": "KV cache blocks in use on the instance",
    "num_kv_blocks_total": "KV cache blocks of the instance",
    "num_running_requests": "Requests running on the instance",
    "num_preemptions_total": "Requests the instance's scheduler preempted (recomputed later), since it started",
    "num_unfinished_requests": "Requests not finished on the instance",
    "kv_transfer_sent_bytes_total": "KV bytes the instance sent (NIXL), since it started",
    "kv_transfer_received_bytes_total": "KV bytes the instance received (NIXL), since it started",
    "kv_transfer_sends_done_total": "KV transfers the instance completed sending",
    "kv_transfer_send_seconds_sum": "Seconds the instance's KV sends took (post to completion), summed; / sends done = "
                                    "the mean KV-transfer time",
    "engine_steps_total": "Engine steps the instance ran",
    "engine_step_seconds_total": "Seconds of the instance's engine steps (schedule + model + sample), summed; / steps = "
                                 "the mean step time",
    "kv_transfer_recvs_done_total": "KV transfers the instance completed receiving",
    "vision_images_total": "Images the vision instance was asked to encode",
    "vision_images_encoded_total": "Images the vision instance encoded (cache misses)",
    "vision_cache_hits_total": "Images the vision instance served from its embedding cache",
    "vision_pending_image_tokens": "Image tokens waiting to be encoded on the vision instance",
    "embeddings_served_bytes_total": "Image-embedding bytes prefill instances READ from the vision instance (NIXL)",
    "embeddings_read_bytes_total": "Image-embedding bytes the prefill instance READ from vision instances (NIXL)",
    "spec_decode_acceptance_rate": "Speculative decoding: accepted / verified drafts on the decode instance",
    "spec_decode_mean_accepted_length": "Speculative decoding: tokens emitted per verification (the sampled one included)",
    "spec_decode_verified_tokens_per_step": "Speculative decoding: target positions verified per step",
    "spec_decode_accepted_drafts_total": "Speculative decoding: drafts accepted on the decode instance",
    "spec_decode_verified_drafts_total": "Speculative decoding: drafts verified on the decode instance",
    "spec_decode_emitted_tokens_total": "Speculative decoding: tokens emitted by verifications on the decode instance",
    "spec_decode_imported_drafts_total": "Speculative decoding: first-block drafts the prefill sent with the KV, "
                                         "queued for verification on the decode instance",
    "prefix_cache_hit_rate": "Prompt tokens served from the instance's prefix cache / prompt tokens it scheduled",
    "prefix_cache_queried_tokens_total": "Prompt tokens of the requests the instance scheduled, since it started",
    "prefix_cache_hit_tokens_total": "Prompt tokens served from the instance's prefix cache, since it started",
    **KVSTORE_STATS,  # the persistent KV store (`kvstore.metrics`); its per-class figures: `kvstore_class` below
}
"""Worker Health stats exported per instance (as gauges: they are read, not counted, here)."""

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _PhaseCollector:
    """`deepinfer_entrypoint_phase_seconds{phase}`: the entrypoint's phase latency histograms (queue, prefill,
    first_decode; `entrypoint.server.PhaseTimes`) as its Health last reported them."""

    def __init__(self) -> None:
        self.phases: dict[str, dict] = {}

    def collect(self):
        family = HistogramMetricFamily("deepinfer_entrypoint_phase_seconds",
                                       "Request phases at the entrypoint: queue (accepted -> prefill sent), prefill "
                                       "(-> prefilled, KV on decode), first_decode (-> decode's first chunk)",
                                       labels=["phase"])
        for phase, h in sorted(self.phases.items()):
            try:
                family.add_metric([phase], _histogram_buckets(h), h["sum"])
            except (KeyError, TypeError, IndexError):
                continue  # an entrypoint of another version: leave the phase out
        yield family


def _histogram_buckets(h: dict) -> list[tuple[str, float]]:
    """A histogram of `engine.latency.LatencyHistograms.as_dict()`'s shape as prometheus_client buckets."""
    return [(f"{le:g}", c) for le, c in zip(h["le"], h["buckets"])] + [("+Inf", h["buckets"][-1])]


class _StageCollector:
    """The stage instances' histograms and errors, as their Health last reported them (`set_stages`):

    * `deepinfer_stage_latency_seconds{stage,instance,phase}`: `queue` (entered the engine's scheduler -> first
      scheduled; on decode after the KV landed), `prefill` (first scheduled -> first token: the prompt's
      compute), `step` (one engine step: the decode step time on decode instances), `kv_transfer` (a KV send,
      posted -> done, on prefill instances);
    * `deepinfer_stage_errors_total{stage,instance,cause}`: in-band errors the instance answered, by cause
      (`serving.errors.cause_of`)."""

    def __init__(self) -> None:
        self.stats: dict[tuple[str, str], dict] = {}

    def collect(self):
        latency = HistogramMetricFamily("deepinfer_stage_latency_seconds",
                                        "Per-stage latencies on each instance: queue, prefill, step (engine step; the "
                                        "decode step on decode), kv_transfer (KV send, posted -> done)",
                                        labels=["stage", "instance", "phase"])
        errors = CounterMetricFamily("deepinfer_stage_errors", "In-band errors each instance answered, by cause",
                                     labels=["stage", "instance", "cause"])
        for (stage, instance_id), stats in sorted(self.stats.items()):
            hists = stats.get("latency_seconds")
            for phase, h in sorted(hists.items()) if isinstance(hists, dict) else ():
                try:
                    latency.add_metric([stage, instance_id, phase], _histogram_buckets(h), h["sum"])
                except (KeyError, TypeError, IndexError):
                    continue  # an instance of another version: leave the phase out
            causes = stats.get("errors_by_cause")
            for cause, n in sorted(causes.items()) if isinstance(causes, dict) else ():
                if isinstance(n, (int, float)):
                    errors.add_metric([stage, instance_id, cause], n)
        yield latency
        yield errors


class HttpMetrics:
    """The front's counters, histograms and gauges (prefix `deepinfer_http_`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("deepinfer_http_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("deepinfer_http_time_to_first_token_seconds", "Request accepted -> first token",
                              ["endpoint"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("deepinfer_http_inter_token_latency_seconds", "Time between streamed tokens",
                             ["endpoint"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("deepinfer_http_request_duration_seconds", "Request accepted -> last token",
                             ["endpoint"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("deepinfer_http_prompt_tokens", "Prompt tokens sent to the cluster",
                                     ["endpoint"], registry=r)
        self.completion_tokens = Counter("deepinfer_http_completion_tokens", "Output tokens received",
                                         ["endpoint"], registry=r)
        self.cached_prompt_tokens = Counter("deepinfer_http_cached_prompt_tokens",
                                            "Prompt tokens served from a prefix cache", ["endpoint"], registry=r)
        self.inflight = Gauge("deepinfer_http_requests_in_flight", "Generation requests being served here",
                              registry=r)
        self.rejected = Counter("deepinfer_http_rejected_requests", "Requests refused because the server was full",
                                registry=r)
        self.errors = Counter("deepinfer_http_errors", "Error answers by cause (the error's code) and status",
                              ["code", "status"], registry=r)
        self.key_requests = Counter("deepinfer_http_key_requests",
                                    "Generation requests by API key name (a configured name or a hash, never the key)"
                                    " and status", ["key", "status"], registry=r)
        self.prefix_cache_hit_rate = Gauge("deepinfer_http_prefix_cache_hit_rate",
                                           "Cached / all prompt tokens of the requests finished so far", registry=r)
        self.cluster_inflight = Gauge("deepinfer_entrypoint_requests_in_flight",
                                      "Requests in flight at the token-level entrypoint (its Health)", registry=r)
        self.cluster_instances = Gauge("deepinfer_entrypoint_healthy_instances",
                                       "Healthy instances per stage as the entrypoint sees them", ["stage"],
                                       registry=r)
        self.cluster_healthy = Gauge("deepinfer_entrypoint_healthy", "1 when the entrypoint reports healthy",
                                     registry=r)

        self.phases = _PhaseCollector()
        r.register(self.phases)

        self.stage = {name: Gauge(f"deepinfer_stage_{name}", help_, ["stage", "instance"], registry=r)
                      for name, help_ in STAGE_STATS.items()}
        self.kvstore_class = {name: Gauge(f"deepinfer_stage_kvstore_class_{name}", help_,
                                          ["stage", "instance", "traffic_class"], registry=r)
                              for name, help_ in KVSTORE_CLASS_STATS.items()}
        """The KV store's per-class figures of each instance (Health stats `kvstore_classes`)."""
        self.stage_histograms = _StageCollector()
        r.register(self.stage_histograms)

    def update_hit_rate(self) -> None:
        """Recompute the prefix-cache hit rate from the token counters (all endpoints)."""
        prompt = sum(s.value for m in self.prompt_tokens.collect() for s in m.samples if s.name.endswith("_total"))
        cached = sum(s.value for m in self.cached_prompt_tokens.collect() for s in m.samples
                     if s.name.endswith("_total"))
        self.prefix_cache_hit_rate.set(cached / prompt if prompt else 0.0)

    def set_stages(self, stats_by_instance: dict[tuple[str, str], dict]) -> None:
        """Replace the per-instance gauges, histograms and error counts with `{(stage, instance_id): Health stats}`."""
        self.stage_histograms.stats = dict(stats_by_instance)
        for name, gauge in self.stage.items():
            gauge.clear()
            for (stage, instance_id), stats in stats_by_instance.items():
                if isinstance(stats.get(name), (int, float)):
                    gauge.labels(stage, instance_id).set(stats[name])
        for name, gauge in self.kvstore_class.items():
            gauge.clear()
            for (stage, instance_id), stats in stats_by_instance.items():
                classes = stats.get("kvstore_classes")
                for cls, figures in (classes.items() if isinstance(classes, dict) else ()):
                    if isinstance(figures, dict) and isinstance(figures.get(name), (int, float)):
                        gauge.labels(stage, instance_id, cls).set(figures[name])

    def set_cluster(self, is_healthy: bool, stats: dict) -> None:
        self.cluster_healthy.set(1 if is_healthy else 0)
        if isinstance(stats.get("phase_seconds"), dict):
            self.phases.phases = stats["phase_seconds"]
        if "num_inflight_requests" in stats:
            self.cluster_inflight.set(stats["num_inflight_requests"])
        for stage in ("prefill", "decode", "vision"):
            if f"num_{stage}_instances" in stats:
                self.cluster_instances.labels(stage).set(stats[f"num_{stage}_instances"])
