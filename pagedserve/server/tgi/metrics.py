"""TGI's metric names (`--tgi-metrics`): the server's own measurements, also exported under the
names TGI's dashboards and alerts query (tgi_request_count, tgi_request_duration, tgi_queue_size, ...).

Nothing is measured twice: at scrape time this collector reads the `pagedserve:` families from
the same registry and re-emits them renamed, without the model_name label (TGI serves one
model). TGI's counters carry no `_total` suffix, so they are written as raw counter samples.
"""
from __future__ import annotations

from prometheus_client.metrics_core import Metric

P = "pagedserve:"
# TGI histogram name ← our histogram family name
_HISTOGRAMS = {
    "tgi_request_duration": ("e2e_request_latency_seconds", "Request end-to-end duration (s)."),
    "tgi_request_queue_duration": ("request_queue_time_seconds", "Time requests spent waiting in the queue (s)."),
    "tgi_request_inference_duration": ("request_inference_time_seconds", "Request inference duration (s)."),
    "tgi_request_generated_tokens": ("request_generation_tokens", "Generated tokens per request."),
    "tgi_request_input_length": ("request_prompt_tokens", "Input tokens per request."),
}


class TGIMetricsCollector:
    def __init__(self, metrics):
        self.m = metrics

    def describe(self):
        return []  # names are fixed; collected only at scrape time

    def _source(self) -> dict[str, list]:
        """{sample name: [samples]} of the pagedserve families this collector translates."""
        names = [P + src for src, _ in _HISTOGRAMS.values()]
        names = [n + s for n in names for s in ("_bucket", "_sum", "_count")]
        names += [P + "request_success_total", P + "admission_rejections_total"]
        out: dict[str, list] = {}
        for fam in self.m.registry.restricted_registry(names).collect():
            for s in fam.samples:
                out.setdefault(s.name, []).append(s)
        return out

    def collect(self):
        src = self._source()

        def total(name: str, **want) -> float:
            return sum(s.value for s in src.get(P + name, ()) if all(s.labels.get(k) == v for k, v in want.items()))

        ok = total("request_success_total", finished_reason="stop") + total("request_success_total",
                                                                            finished_reason="length")
        aborted = total("request_success_total", finished_reason="abort")
        rejected = total("admission_rejections_total")

        def counter(name: str, doc: str, samples: list[tuple[dict, float]]) -> Metric:
            m = Metric(name, doc, "counter")
            for labels, v in samples:
                m.add_sample(name, labels, v)
            return m

        yield counter("tgi_request_count", "Requests received.", [({}, ok + aborted + rejected)])
        yield counter("tgi_request_success", "Requests that finished.", [({}, ok)])
        yield counter("tgi_request_failure", "Requests that failed, by error.",
                      [({"err": "aborted"}, aborted), ({"err": "overloaded"}, rejected)])

        s = self.m.stats_fn() if self.m.stats_fn is not None else None
        for name, doc, key in (("tgi_queue_size", "Requests waiting in the queue.", "num_waiting"),
                               ("tgi_batch_current_size", "Requests in the running batch.", "num_running")):
            g = Metric(name, doc, "gauge")
            g.add_sample(name, {}, float(getattr(s, key, 0) or 0) if s is not None else 0.0)
            yield g

        for name, (base, doc) in _HISTOGRAMS.items():
            h = Metric(name, doc, "histogram")
            for suffix in ("_bucket", "_sum", "_count"):
                for smp in src.get(P + base + suffix, ()):
                    labels = {k: v for k, v in smp.labels.items() if k != "model_name"}
                    h.add_sample(name + suffix, labels, smp.value)
            yield h
