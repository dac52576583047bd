// The live dashboard: gauges with the latest sample and small uPlot time series of the last
// five minutes, fed by /ui/stats (one sample per second, the recent history first).

import { api, readSSE, Unauthorized } from "./api.js";
import { el, fmt } from "./format.js";

const SPAN_S = 300;
const COLORS = ["#2563eb", "#16a34a", "#dc2626", "#9333ea"];
const q = (key, p) => (s) => (s[key] ? s[key][p] : null);
const pct = (key) => (s) => (s[key] == null ? null : 100 * s[key]);
const ms = (f) => (s) => { const v = f(s); return v == null ? null : 1000 * v; };

const GAUGES = [
  { id: "prompt-tps", label: "Tokens/s in", value: (s) => s.prompt_tps, format: fmt.rate },
  { id: "generation-tps", label: "Tokens/s out", value: (s) => s.generation_tps, format: fmt.rate },
  { id: "running", label: "Running", value: (s) => s.running, format: fmt.int },
  { id: "waiting", label: "Waiting", value: (s) => s.waiting, format: fmt.int },
  { id: "kv-usage", label: "KV cache used", value: (s) => s.kv_usage, format: fmt.pct },
  { id: "prefix-hit", label: "Prefix-cache hits", value: (s) => s.prefix_hit_rate, format: fmt.pct },
  { id: "ttft-p50", label: "TTFT p50", value: q("ttft", "p50"), format: fmt.seconds },
  { id: "itl-p50", label: "ITL p50", value: q("itl", "p50"), format: fmt.seconds },
  { id: "e2e-p50", label: "E2E p50", value: q("e2e", "p50"), format: fmt.seconds },
  { id: "preemptions", label: "Preemptions", value: (s) => s.preemptions_total, format: fmt.int },
];

const percentiles = (key, scale = ms) => ["p50", "p90", "p99"].map((p) => ({ label: p, value: scale(q(key, p)) }));
const CHARTS = [
  { id: "throughput", title: "Tokens / s", series: [
    { label: "in (prompt)", value: (s) => s.prompt_tps }, { label: "out (generated)", value: (s) => s.generation_tps }] },
  { id: "requests", title: "Requests", series: [
    { label: "running", value: (s) => s.running }, { label: "waiting", value: (s) => s.waiting }] },
  { id: "kv", title: "KV-cache usage %", max: 100, series: [{ label: "used", value: pct("kv_usage") }] },
  { id: "prefix", title: "Prefix-cache hit rate % (last minute)", max: 100,
    series: [{ label: "hits", value: pct("prefix_hit_rate") }] },
  { id: "ttft", title: "Time to first token, ms (last minute)", series: percentiles("ttft") },
  { id: "itl", title: "Inter-token latency, ms (last minute)", series: percentiles("itl") },
  { id: "e2e", title: "End-to-end latency, s (last minute)", series: percentiles("e2e", (f) => f) },
  { id: "preemptions", title: "Preemptions / s", series: [{ label: "preemptions", value: (s) => s.preemptions_ps }] },
];

function chartWidth(box) {
  return Math.max(220, Math.floor(box.getBoundingClientRect().width) - 2);
}

function makeChart(spec, box) {
  const axisValues = (u, vals) => vals.map((v) => (v >= 1000 ? +(v / 1000).toFixed(1) + "k" : String(+v.toFixed(2))));
  const opts = {
    width: chartWidth(box),
    height: 130,
    legend: { show: true, live: false },
    cursor: { drag: { x: false, y: false } },
    scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, spec.max || Math.max(1, hi * 1.1)] } },
    axes: [{ space: 70, size: 28 }, { size: 50, values: axisValues }],
    series: [{}, ...spec.series.map((s, i) => ({ label: s.label, stroke: COLORS[i], width: 1.5, spanGaps: false }))],
  };
  return new uPlot(opts, [[], ...spec.series.map(() => [])], box);
}

// What `pagedserve doctor` would say about the last minute: each finding, its evidence and the flag to change.
function renderDiagnoses(diagnoses) {
  const box = document.getElementById("doctor-list");
  if (diagnoses == null) return; // not enough samples yet: keep the placeholder
  box.dataset.count = String(diagnoses.length);
  if (!diagnoses.length) {
    box.replaceChildren("No problems found in the last minute.");
    return;
  }
  box.replaceChildren(...diagnoses.map((d) => el("div", { class: "diagnosis", "data-id": d.id },
    el("div", { class: "title", text: d.title }),
    el("ul", {}, ...d.evidence.map((e) => el("li", { text: e }))),
    el("div", { class: "change" }, "change: ", el("code", { text: d.change })))));
}

export class Dashboard {
  constructor(onUnauthorized) {
    this.onUnauthorized = onUnauthorized;
    this.samples = [];
    this.status = document.getElementById("feed-status");
    this.gauges = new Map();
    const gaugeBox = document.getElementById("gauges");
    for (const g of GAUGES) {
      const value = el("div", { class: "value", text: fmt.int(null) });
      const node = el("div", { class: "gauge", "data-testid": "gauge-" + g.id }, el("div", { class: "label", text: g.label }), value);
      gaugeBox.append(node);
      this.gauges.set(g.id, { node, value });
    }
    const chartBox = document.getElementById("charts");
    this.charts = CHARTS.map((spec) => {
      const box = el("div", { class: "chart", "data-testid": "chart-" + spec.id });
      box.append(el("div", { class: "chart-title", text: spec.title }));
      chartBox.append(box);
      return { spec, box, plot: makeChart(spec, box) };
    });
    window.addEventListener("resize", () => {
      for (const c of this.charts) c.plot.setSize({ width: chartWidth(c.box), height: 130 });
    });
  }

  setStatus(state, text) {
    this.status.dataset.state = state;
    this.status.textContent = text;
  }

  async run() {
    for (;;) {
      try {
        const response = await api("/ui/stats", { headers: { Accept: "text/event-stream" } });
        if (!response.ok) throw new Error("HTTP " + response.status);
        this.setStatus("live", "live");
        for await (const ev of readSSE(response)) {
          if (ev.event === "history") this.samples = JSON.parse(ev.data);
          else this.samples.push(JSON.parse(ev.data));
          this.render();
        }
      } catch (e) {
        if (e instanceof Unauthorized) {
          this.setStatus("locked", "API key needed");
          this.onUnauthorized(e.message);
          return;
        }
      }
      this.setStatus("down", "disconnected, retrying");
      await new Promise((r) => setTimeout(r, 1000));
    }
  }

  render() {
    const last = this.samples[this.samples.length - 1];
    if (!last) return;
    const t0 = last.t - SPAN_S;
    while (this.samples.length && this.samples[0].t < t0) this.samples.shift();
    if (!last.alive) this.setStatus("down", "engine stopped");
    else this.setStatus("live", "live");
    for (const g of GAUGES) {
      const v = g.value(last);
      const { node, value } = this.gauges.get(g.id);
      value.textContent = g.format(v);
      node.dataset.value = v == null ? "" : String(v);
    }
    renderDiagnoses(last.diagnoses);
    const ts = this.samples.map((s) => s.t);
    for (const c of this.charts) {
      c.plot.setData([ts, ...c.spec.series.map((s) => this.samples.map((x) => { const v = s.value(x); return v == null ? null : v; }))]);
    }
  }
}
