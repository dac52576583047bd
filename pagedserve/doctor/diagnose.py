"""The symptom table as code: window statistics in, diagnoses (evidence + the flag to change) out.

    many preemptions            → the KV cache is too small       → more KV (or fewer sequences)
    requests wait, batch full   → queue backlog at max_num_seqs   → raise --max-num-seqs if KV has room
    requests wait, KV full      → KV bounds the batch (throughput flat) → more KV, or more replicas
    slow TTFT, long prompts     → whole-prompt prefill            → --enable-chunked-prefill
    slow TTFT otherwise         → prefill compute                 → smaller prefill steps, prefix caching
    503s at admission           → queue limit reached             → raise it, or more replicas
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pagedserve.doctor.scrape import Scrape, bucket_delta, quantile

LONG_PROMPT_TOKENS = 256  # prompts this long make whole-prompt prefill visible in TTFT
KV_FULL = 0.9  # KV usage at or above this is "full"


@dataclass
class Diagnosis:
    id: str
    title: str
    evidence: list[str]
    change: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class WindowStats:
    seconds: float
    finished: float = 0.0
    preemptions: float = 0.0
    rejections: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    waiting_mean: float = 0.0
    waiting_max: float = 0.0
    waiting_frac: float = 0.0  # fraction of samples with requests waiting
    running_max: float = 0.0
    kv_mean: float = 0.0
    kv_max: float = 0.0
    num_blocks: float = 0.0
    ttft_mean: float | None = None
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    ttft_p99: float | None = None
    queue_mean: float | None = None
    e2e_mean: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    prompt_len_mean: float | None = None
    prefix_hit_rate: float | None = None
    samples: int = 0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _mean(first: Scrape, last: Scrape, name: str) -> float | None:
    n = last.total(name + "_count") - first.total(name + "_count")
    return (last.total(name + "_sum") - first.total(name + "_sum")) / n if n > 0 else None


def window_stats(scrapes: list[Scrape]) -> WindowStats:
    first, last = scrapes[0], scrapes[-1]
    p = last.prefix()

    def delta(name: str, **labels) -> float:
        return last.total(p + name, **labels) - first.total(p + name, **labels)

    def hist(name: str):
        return bucket_delta(first.buckets(p + name), last.buckets(p + name))

    w = WindowStats(seconds=max(last.t - first.t, 1e-9), samples=len(scrapes))
    w.finished = sum(delta("request_success_total", finished_reason=r) for r in ("stop", "length"))
    w.preemptions = delta("num_preemptions_total")
    w.rejections = delta("admission_rejections_total")
    w.prompt_tokens = delta("prompt_tokens_total")
    w.generation_tokens = delta("generation_tokens_total")
    waiting = [s.total(p + "num_requests_waiting") for s in scrapes]
    running = [s.total(p + "num_requests_running") for s in scrapes]
    kv = [s.total(p + "kv_cache_usage_perc") for s in scrapes]
    w.waiting_mean, w.waiting_max = sum(waiting) / len(waiting), max(waiting)
    w.waiting_frac = sum(x > 0 for x in waiting) / len(waiting)
    w.running_max = max(running)
    w.kv_mean, w.kv_max = sum(kv) / len(kv), max(kv)
    w.num_blocks = last.total(p + "num_kv_cache_blocks")
    ttft = hist("time_to_first_token_seconds")
    w.ttft_p50, w.ttft_p90, w.ttft_p99 = (quantile(q, ttft) for q in (0.5, 0.9, 0.99))
    w.ttft_mean = _mean(first, last, p + "time_to_first_token_seconds")
    w.queue_mean = _mean(first, last, p + "request_queue_time_seconds")
    w.e2e_mean = _mean(first, last, p + "e2e_request_latency_seconds")
    itl = hist("inter_token_latency_seconds")
    w.itl_p50, w.itl_p99 = quantile(0.5, itl), quantile(0.99, itl)
    w.prompt_len_mean = _mean(first, last, p + "request_prompt_tokens")
    queries = delta("prefix_cache_queries_total")
    w.prefix_hit_rate = delta("prefix_cache_hits_total") / queries if queries > 0 else None
    return w


# -- flag advice ------------------------------------------------------------------------------------
def _now(cfg: dict, key: str, unit: str = "") -> str:
    v = cfg.get(key)
    return f"now {v}{unit}" if v is not None else "current value unknown"


def more_kv(cfg: dict) -> str:
    """The flag that gives the engine more KV blocks on this server."""
    n = cfg.get("num_gpu_blocks_override")
    if n:
        return f"--num-gpu-blocks-override {2 * n} (now {n}), or lower --max-num-seqs"
    if cfg.get("device") == "cuda":
        u = cfg.get("gpu_memory_utilization")
        target = f"{min(0.95, u + 0.05):.2f}" if u else "0.95"
        return f"--gpu-memory-utilization {target} ({_now(cfg, 'gpu_memory_utilization')}), or lower --max-num-seqs"
    space = cfg.get("kv_cache_space")
    target = f"{2 * space:g}" if space else "8"
    return f"--kv-cache-space {target} ({_now(cfg, 'kv_cache_space', ' GiB')}), or lower --max-num-seqs"


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.0f} ms"


def _pct(v: float) -> str:
    return f"{v * 100:.0f} %"


# -- live diagnoses ----------------------------------------------------------------------------------
def diagnose_live(w: WindowStats, cfg: dict, ttft_slo_s: float) -> list[Diagnosis]:
    out: list[Diagnosis] = []
    max_seqs = cfg.get("max_num_seqs")
    per_req = f" ({w.preemptions / w.finished:.1f} per finished request)" if w.finished else ""

    if w.preemptions > 0:
        out.append(Diagnosis(
            "preemptions", "KV cache too small: running requests are preempted and their prompts recomputed",
            [f"{w.preemptions:g} preemptions in {w.seconds:.0f} s{per_req}",
             f"KV cache usage peaked at {_pct(w.kv_max)} (mean {_pct(w.kv_mean)}) of {w.num_blocks:g} blocks"],
            more_kv(cfg)))

    if w.waiting_frac >= 0.5 and w.waiting_max >= 1:
        evidence = [f"requests waited in {_pct(w.waiting_frac)} of {w.samples} samples "
                    f"(mean {w.waiting_mean:.1f}, max {w.waiting_max:g})",
                    f"running batch peaked at {w.running_max:g} sequences (--max-num-seqs {max_seqs})",
                    f"KV cache usage peaked at {_pct(w.kv_max)}"]
        if w.queue_mean is not None and w.e2e_mean:
            evidence.append(f"mean queue time {_ms(w.queue_mean)} of mean end-to-end {_ms(w.e2e_mean)} "
                            f"({_pct(w.queue_mean / w.e2e_mean)})")
        batch_full = max_seqs is not None and w.running_max >= max_seqs
        if w.kv_max >= KV_FULL:
            out.append(Diagnosis("kv_bound_batch", "The KV cache bounds the batch: throughput stays flat while "
                                 "requests queue", evidence, f"{more_kv(cfg)}; or add replicas"))
        elif batch_full:
            out.append(Diagnosis("queue_backlog", f"Queue backlog: the batch is full at --max-num-seqs {max_seqs} "
                                 "while the KV cache has room", evidence,
                                 f"--max-num-seqs {2 * max_seqs} (now {max_seqs}); or add replicas "
                                 "(the HPA scales on num_requests_waiting)"))
        else:
            out.append(Diagnosis("queue_backlog", "Queue backlog: requests wait although the batch and the KV "
                                 "cache have room (the per-step token budget is the limit)", evidence,
                                 "--max-num-batched-tokens higher "
                                 f"({_now(cfg, 'max_num_batched_tokens')}); or add replicas"))

    if w.ttft_p90 is not None and w.ttft_p90 > ttft_slo_s:
        evidence = [f"TTFT P50 {_ms(w.ttft_p50)}, P90 {_ms(w.ttft_p90)}, P99 {_ms(w.ttft_p99)} "
                    f"(target {_ms(ttft_slo_s)})"]
        if w.prompt_len_mean is not None:
            evidence.append(f"prompts average {w.prompt_len_mean:.0f} tokens")
        if w.queue_mean is not None and w.ttft_mean:
            evidence.append(f"mean queue time {_ms(w.queue_mean)} of mean TTFT {_ms(w.ttft_mean)}")
        if w.itl_p50 is not None and w.itl_p99 is not None:
            evidence.append(f"inter-token latency P50 {_ms(w.itl_p50)}, P99 {_ms(w.itl_p99)} "
                            "(decode stalls while whole prompts prefill)")
        long_prompts = (w.prompt_len_mean or 0) >= LONG_PROMPT_TOKENS
        if cfg.get("enable_chunked_prefill") is False and long_prompts:
            evidence.insert(0, "chunked prefill is off: each prompt is prefilled whole, in one step")
            out.append(Diagnosis("slow_ttft_long_prompts", "Slow TTFT: long prompts prefilled whole",
                                 evidence, "--enable-chunked-prefill --max-num-batched-tokens 2048"))
        elif not any(d.id in ("queue_backlog", "kv_bound_batch") for d in out):
            change = "--max-num-batched-tokens lower (smaller prefill steps interleave with decode; " \
                     f"{_now(cfg, 'max_num_batched_tokens')})"
            if cfg.get("enable_prefix_caching") is False:
                change = "--enable-prefix-caching (shared prompt prefixes are recomputed today)"
            out.append(Diagnosis("slow_ttft_prefill", "Slow TTFT: prefill compute", evidence, change))

    if w.rejections > 0:
        out.append(Diagnosis("admission_rejections", "Requests rejected with 503: the waiting queue limit was reached",
                             [f"{w.rejections:g} rejections in {w.seconds:.0f} s"],
                             "--max-num-queued-reqs / --max-num-queued-tokens higher, or add replicas"))
    return out


# -- diagnoses from a `bench serve` result --------------------------------------------------------
def diagnose_bench(result: dict, cfg: dict, ttft_slo_s: float) -> list[Diagnosis]:
    s, m, c = result.get("summary", {}), result.get("metrics", {}), result.get("config", {})
    ttft, itl = m.get("ttft_ms") or {}, m.get("itl_ms") or {}
    conc = s.get("max_concurrency_observed") or 0
    max_seqs = cfg.get("max_num_seqs")
    out: list[Diagnosis] = []

    if s.get("failed"):
        errors = s.get("errors") or []
        overload = [e for e in errors if any(k in e for k in ("503", "429", "overloaded"))]
        if overload:
            out.append(Diagnosis("admission_rejections", "Requests rejected as overloaded",
                                 [f"{s['failed']} of {s.get('num_prompts')} requests failed", *overload[:3]],
                                 "--max-num-queued-reqs / --max-concurrent-requests higher, or add replicas"))
        else:
            out.append(Diagnosis("request_failures", "Requests failed", [f"{s['failed']} failed", *errors[:3]],
                                 "read the errors above; the server log has the details"))

    t_min, t_med, t_p99 = ttft.get("min"), ttft.get("median"), ttft.get("p99")
    # without a queue every request's first token comes after about one prefill; twice the fastest
    # one at the median means half the requests waited for others to finish
    if t_min and t_med and t_med > 2 * t_min and conc > 1:
        evidence = [f"TTFT spreads from {t_min:.0f} ms (min) to {t_med:.0f} ms (median) and {t_p99:.0f} ms (P99): "
                    "later requests waited for a batch slot",
                    f"the benchmark kept up to {conc} requests in flight"]
        if max_seqs is not None and max_seqs < conc:
            evidence.append(f"the server runs at most {max_seqs} sequences at once (--max-num-seqs)")
            change = f"--max-num-seqs {conc} (now {max_seqs}) if the KV cache has room; or add replicas"
        else:
            change = "add replicas, or lower the client's concurrency"
        out.append(Diagnosis("queue_backlog", "Queue backlog: TTFT grows with queue position", evidence, change))

    i_med, i_p99 = itl.get("median"), itl.get("p99")
    if i_med and i_p99 and i_p99 > 5 * i_med:
        change = ("--enable-chunked-prefill" if cfg.get("enable_chunked_prefill") is False
                  else "--max-num-batched-tokens lower (smaller prefill steps)")
        out.append(Diagnosis("decode_stalls", "Decode stalls: some token gaps are much longer than usual",
                             [f"inter-token latency median {i_med:.1f} ms, P99 {i_p99:.1f} ms"], change))

    in_len = c.get("random_input_len") or 0
    if ttft.get("p90") and ttft["p90"] > ttft_slo_s * 1000 and in_len >= LONG_PROMPT_TOKENS \
            and cfg.get("enable_chunked_prefill") is False:
        out.append(Diagnosis("slow_ttft_long_prompts", "Slow TTFT: long prompts prefilled whole",
                             [f"TTFT P90 {ttft['p90']:.0f} ms with {in_len}-token prompts; chunked prefill is off"],
                             "--enable-chunked-prefill --max-num-batched-tokens 2048"))
    return out
