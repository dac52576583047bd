"""Prometheus metrics for the server, named as vLLM names them (prefix `pagedserve:`).

Everything lives in the server's own CollectorRegistry (several servers may share a process in
tests). Load gauges and the engine's cumulative counters (preemptions, prefix-cache tokens) are
read from the engine's stats snapshot at scrape time by a custom collector; per-request
counters and histograms are fed by AsyncEngine's observer hooks from the engine thread
(prometheus_client is thread-safe).
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagedserve.engine.request_stream import EngineObserver, RequestStream

PREFIX = "pagedserve:"

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0]


def _1_2_5_buckets(maximum: int) -> list[float]:
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > maximum:
                return [float(x) for x in out] or [1.0]
            out.append(v)
        exp += 1


@dataclass(frozen=True)
class StepCostModel:
    """Per-step work estimated from the model's shapes, for the estimated_*_per_gpu counters: the
    linear layers' FLOPs per computed token, the LM head's per sampled token, every weight read
    once per step, each computed token's K and V written once. Attention over the context is
    not counted (it depends on every sequence's length)."""

    device: str
    linear_params: int  # weights the decoder layers multiply each token by
    head_params: int  # hidden x vocab
    bytes_per_param: int
    kv_bytes_per_token: int

    @classmethod
    def from_spec(cls, spec, device: str, bytes_per_param: int) -> "StepCostModel":
        h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * spec.intermediate_size
        return cls(device, spec.num_layers * per_layer, h * spec.vocab_size, bytes_per_param,
                   2 * spec.num_layers * kv * bytes_per_param)

    def step(self, computed_tokens: int, sampled_tokens: int) -> tuple[float, float, float]:
        """(FLOPs, bytes read, bytes written) of one step."""
        if computed_tokens <= 0:
            return 0.0, 0.0, 0.0
        flops = 2.0 * (self.linear_params * computed_tokens + self.head_params * sampled_tokens)
        read = float((self.linear_params + self.head_params) * self.bytes_per_param)
        return flops, read, float(self.kv_bytes_per_token * computed_tokens)


def _spec_decode_metrics(sd, name: str, c):
    yield c("spec_decode_num_drafts", "Verifications of draft tokens (one per sequence and step).", sd.num_drafts)
    yield c("spec_decode_num_draft_tokens", "Draft tokens proposed.", sd.num_draft_tokens)
    yield c("spec_decode_num_accepted_tokens", "Draft tokens accepted.", sd.num_accepted_tokens)
    f = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position.",
                            labels=["model_name", "position"])
    for pos, n in enumerate(sd.num_accepted_tokens_per_pos):
        f.add_metric([name, str(pos)], float(n))
    yield f


class _StatsCollector:
    """Gauges and engine-cumulative counters, read from the engine's stats snapshot on scrape."""

    def __init__(self, metrics: "ServerMetrics"):
        self.m = metrics

    def describe(self):
        return []  # unchecked collector: names are fixed, no need to pre-describe

    def collect(self):
        s = self.m.stats_fn() if self.m.stats_fn is not None else None
        name = self.m.model_name

        def g(metric, doc, value):
            f = GaugeMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            f.add_metric([name], float(value or 0))
            return f

        def c(metric, doc, value):
            f = CounterMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            f.add_metric([name], float(value or 0))
            return f

        get = (lambda k: getattr(s, k, 0) or 0) if s is not None else (lambda k: 0)
        usage = float(get("kv_cache_usage"))
        yield g("num_requests_running", "Number of requests in the running batch.", get("num_running"))
        yield g("num_requests_waiting", "Number of requests waiting to be scheduled.", get("num_waiting"))
        by_reason = GaugeMetricFamily(PREFIX + "num_requests_waiting_by_reason",
                                      "Waiting requests by reason: 'capacity' (no room in the batch or the KV "
                                      "cache); 'deferred' (held for something else) never happens here.",
                                      labels=["model_name", "reason"])
        by_reason.add_metric([name, "capacity"], float(get("num_waiting")))
        by_reason.add_metric([name, "deferred"], 0.0)
        yield by_reason
        yield g("kv_cache_usage_perc", "KV-cache usage (fraction of blocks in use, 0..1).", usage)
        yield g("gpu_cache_usage_perc", "Deprecated: kv_cache_usage_perc under vLLM v0's name, kept for old "
                                        "dashboards.", usage)
        yield g("num_kv_cache_blocks", "Total KV-cache blocks.", get("num_total_blocks"))
        yield c("num_preemptions", "Cumulative number of preemptions.", get("num_preemptions_total"))
        yield c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", get("prefix_cache_queries"))
        yield c("prefix_cache_hits", "Prompt tokens found in the prefix cache.", get("prefix_cache_hits"))
        if self.m.cache_config:
            info = InfoMetricFamily(PREFIX + "cache_config", "The KV cache's configuration.")
            info.add_metric([], self.m.cache_config)
            yield info
        sd = getattr(s, "spec_decode", None)
        if sd is not None:  # speculative decoding on: vLLM's spec_decode_* counters
            yield from _spec_decode_metrics(sd, name, c)


class ServerMetrics(EngineObserver):
    """cache_config: label -> value for cache_config_info; cost: the estimated_*_per_gpu model."""

    def __init__(self, model_name: str, max_model_len: int = 8192, stats_fn=None,
                 cache_config: dict[str, str] | None = None, cost: StepCostModel | None = None):
        self.model_name = model_name
        self.stats_fn = stats_fn
        self.cache_config = {k: str(v) for k, v in (cache_config or {}).items()}
        self.cost = cost
        self.registry = CollectorRegistry(auto_describe=True)
        r, L = self.registry, ["model_name"]
        tok_buckets = _1_2_5_buckets(max(max_model_len, 1))
        # the standard process_* and python_* families, as a default prometheus_client registry has
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)

        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Number of prefill tokens processed.", L,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Number of generation tokens processed.", L,
                                         registry=r).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Count of finished requests, by finish reason.",
                                L + ["finished_reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)  # expose zeros from the start
        self._rejections = Counter(PREFIX + "admission_rejections",
                                   "Requests rejected with 503 because the waiting queue was full.",
                                   L + ["reason"], registry=r)
        for reason in ("queued_reqs", "queued_tokens"):
            self._rejections.labels(model_name, reason)
        self.iteration_tokens = Histogram(PREFIX + "iteration_tokens_total", "Tokens (prompt + generated) per engine step.",
                                          L, buckets=_1_2_5_buckets(1 << 16), registry=r).labels(model_name)

        def h(metric, doc, buckets):
            return Histogram(PREFIX + metric, doc, L, buckets=buckets, registry=r).labels(model_name)

        self.ttft = h("time_to_first_token_seconds", "Time to first token (s).", _TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Time between token batches of one request (s).", _ITL_BUCKETS)
        # vLLM v0's name for the same thing, so existing dashboards keep working
        self.tpot = h("time_per_output_token_seconds", "Time per output token (s).", _ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "End-to-end request latency (s).", _LATENCY_BUCKETS)
        self.queue_time = h("request_queue_time_seconds", "Time spent waiting before first scheduled (s).",
                            _LATENCY_BUCKETS)
        self.prefill_time = h("request_prefill_time_seconds", "Time from first scheduled to first token (s).",
                              _LATENCY_BUCKETS)
        self.decode_time = h("request_decode_time_seconds", "Time from first to last token (s).", _LATENCY_BUCKETS)
        self.inference_time = h("request_inference_time_seconds", "Time from first scheduled to finished (s).",
                                _LATENCY_BUCKETS)
        self.req_prompt_tokens = h("request_prompt_tokens", "Prompt tokens per finished request.", tok_buckets)
        self.req_gen_tokens = h("request_generation_tokens", "Generated tokens per finished request.", tok_buckets)
        self.req_max_gen_tokens = h("request_max_num_generation_tokens",
                                    "Most tokens one choice of a finished request generated.", tok_buckets)
        self.req_params_max_tokens = h("request_params_max_tokens", "max_tokens of finished requests.", tok_buckets)
        self.req_params_n = h("request_params_n", "n of finished requests.", [1, 2, 5, 10, 20, 50, 100])
        self.req_preemptions = h("request_num_preemptions", "Times a finished request was preempted.",
                                 [0, 1, 2, 5, 10, 20, 50])
        self.req_prefill_computed = h("request_prefill_kv_computed_tokens",
                                      "Prompt tokens a request computed (not found in the prefix cache).", tok_buckets)
        self.req_tpot = h("request_time_per_output_token_seconds",
                          "Per request: decode time / (generated tokens - 1) (s).", _ITL_BUCKETS)
        self.prompt_tokens_cached = Counter(PREFIX + "prompt_tokens_cached",
                                            "Prompt tokens served from the prefix cache.", L,
                                            registry=r).labels(model_name)
        by_source = Counter(PREFIX + "prompt_tokens_by_source", "Prompt tokens by where their KV came from.",
                            L + ["source"], registry=r)
        self.prompt_computed = by_source.labels(model_name, "local_compute")
        self.prompt_cache_hit = by_source.labels(model_name, "local_cache_hit")
        self.prompt_cached_by_source = Counter(PREFIX + "prompt_tokens_cached_by_source",
                                               "Cached prompt tokens by cache.", L + ["source"],
                                               registry=r).labels(model_name, "local_cache_hit")
        if cost is not None:
            def per_device(metric, doc):
                return Counter(PREFIX + metric, doc + " (an estimate from the model's shapes; see StepCostModel).",
                               L + ["device"], registry=r).labels(model_name, cost.device)

            self.est_flops = per_device("estimated_flops_per_gpu", "Floating-point operations done")
            self.est_read = per_device("estimated_read_bytes_per_gpu", "Bytes read from device memory")
            self.est_write = per_device("estimated_write_bytes_per_gpu", "Bytes written to device memory")
        r.register(_StatsCollector(self))

    # -- server hooks ---------------------------------------------------------------------------
    def count_rejection(self, reason: str) -> None:
        self._rejections.labels(self.model_name, reason).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # -- engine-thread hooks (AsyncEngine observer) -----------------------------------------------
    def on_step(self, stats, step_seconds: float) -> None:
        sampled = getattr(stats, "step_generation_tokens", 0) or 0
        n = (getattr(stats, "step_prompt_tokens", 0) or 0) + sampled
        if n:
            self.iteration_tokens.observe(n)
            if self.cost is not None:
                flops, read, write = self.cost.step(n, sampled)
                self.est_flops.inc(flops)
                self.est_read.inc(read)
                self.est_write.inc(write)

    def on_request_output(self, stream: RequestStream, output, num_new_tokens: int, now: float) -> None:
        if stream.tokens_seen == 0:
            # first generated token: the prompt has been processed
            n_prompt = len(output.prompt_token_ids or ()) or stream.num_prompt_tokens
            cached = min(getattr(output, "num_cached_tokens", 0) or 0, n_prompt)
            self.prompt_tokens.inc(n_prompt)
            self.prompt_tokens_cached.inc(cached)
            self.prompt_cached_by_source.inc(cached)
            self.prompt_cache_hit.inc(cached)
            self.prompt_computed.inc(n_prompt - cached)
        else:
            if stream.last_token_time is not None:
                gap = max(0.0, now - stream.last_token_time)
                self.itl.observe(gap)
                self.tpot.observe(gap)
        self.generation_tokens.inc(num_new_tokens)

    def on_request_finished(self, stream: RequestStream, output, now: float) -> None:
        reasons = [o.finish_reason for o in output.outputs if o.finish_reason]
        reason = "stop" if "stop" in reasons else (reasons[0] if reasons else "stop")
        self._success.labels(self.model_name, reason).inc()
        m = getattr(output, "metrics", None)
        arrival = getattr(m, "arrival_time", None) or stream.arrival_time
        sched = getattr(m, "first_scheduled_time", None)
        first = getattr(m, "first_token_time", None) or stream.first_token_time
        last = getattr(m, "last_token_time", None) or stream.last_token_time or now
        fin = getattr(m, "finished_time", None) or now
        self.e2e.observe(max(0.0, fin - arrival))
        if first is not None:
            self.ttft.observe(max(0.0, first - arrival))
            self.decode_time.observe(max(0.0, last - first))
        if sched is not None:
            self.queue_time.observe(max(0.0, sched - arrival))
            self.inference_time.observe(max(0.0, fin - sched))
            if first is not None:
                self.prefill_time.observe(max(0.0, first - sched))
        n_prompt = len(output.prompt_token_ids or ()) or stream.num_prompt_tokens
        self.req_prompt_tokens.observe(n_prompt)
        gen = [len(o.token_ids) for o in output.outputs]
        self.req_gen_tokens.observe(sum(gen))
        self.req_max_gen_tokens.observe(max(gen, default=0))
        self.req_prefill_computed.observe(n_prompt - min(getattr(output, "num_cached_tokens", 0) or 0, n_prompt))
        if getattr(m, "max_tokens", None) is not None:
            self.req_params_max_tokens.observe(m.max_tokens)
        self.req_params_n.observe(getattr(m, "n", None) or len(output.outputs))
        self.req_preemptions.observe(getattr(m, "num_preemptions", 0) or 0)
        if first is not None and max(gen, default=0) > 1:
            self.req_tpot.observe(max(0.0, last - first) / (max(gen) - 1))

    def on_request_aborted(self, stream: RequestStream, now: float) -> None:
        self._success.labels(self.model_name, "abort").inc()
