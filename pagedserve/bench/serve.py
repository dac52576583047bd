"""`pagedserve bench serve`: a streaming load generator for any OpenAI-compatible server.

Requests go out on a schedule (all at once, Poisson/gamma or constant arrivals at
`--request-rate`), optionally capped at `--max-concurrency` in flight, each streaming its answer
(SSE). The client times every chunk carrying text, takes token counts from the server's `usage`
(`stream_options.include_usage`) and reports throughput, latency percentiles and goodput (see
`report.py` for the definitions). Runs are bounded: `--num-prompts` requests, `--timeout` seconds
overall and `--request-timeout` seconds per request.

No torch here: aiohttp, numpy, tqdm (and matplotlib for `--plot`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np

from pagedserve.bench import datasets, report
from pagedserve.bench.report import RequestRecord

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
DEFAULT_VOCAB_FALLBACK = 256  # ids < 256 exist in every byte-level or byte-fallback vocabulary
ERROR_BODY_CHARS = 500


# --------------------------------------------------------------------------------------------
# arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default: %(default)s)")
    g.add_argument("--model", default=None, help="model name to send (default: the first id of GET /v1/models)")
    g.add_argument("--endpoint", default=COMPLETIONS, choices=[COMPLETIONS, CHAT], help="default: %(default)s")
    g.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY if set)")

    g = p.add_argument_group("dataset")
    g.add_argument(
        "--dataset",
        default="random",
        help="random | shared-prefix | FILE.jsonl (lines {\"prompt\": str|[ids], \"output_len\": n}) (default: %(default)s)",
    )
    g.add_argument("--num-prompts", type=int, default=100, help="requests to send (default: %(default)s)")
    g.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (shared-prefix: suffix tokens) (default: %(default)s)")
    g.add_argument("--random-output-len", type=int, default=128, help="max_tokens per request; default output_len for jsonl (default: %(default)s)")
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1 (default: %(default)s)",
    )
    g.add_argument("--shared-prefix-len", type=int, default=256, help="shared-prefix: prefix tokens (default: %(default)s)")
    g.add_argument("--shared-prefix-num-groups", type=int, default=1, help="shared-prefix: distinct prefixes (default: %(default)s)")
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="random token ids are drawn from [3, V) (default: the server's vocab_size from /v1/models "
        f"if it reports one, else {DEFAULT_VOCAB_FALLBACK})",
    )
    g.add_argument(
        "--prompt-format",
        default="auto",
        choices=["auto", "ids", "text"],
        help="random prompts as token-id lists or random words; auto = ids for completions, text for chat",
    )
    g.add_argument("--seed", type=int, default=0, help="seeds prompts and arrival times (default: %(default)s)")

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at once (default: %(default)s)")
    g.add_argument("--arrival", default="poisson", choices=["poisson", "constant"], help="inter-arrival times at --request-rate (default: %(default)s)")
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival times; 1 = Poisson, <1 burstier, >1 more regular (default: %(default)s)",
    )
    g.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask the server to ignore EOS so each request yields its full length (default: on)",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: %(default)s)")
    g.add_argument("--timeout", type=float, default=1800.0, help="overall wall-time bound in seconds (default: %(default)s)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="per-request bound in seconds (default: %(default)s)")

    g = p.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", default=None, metavar="SLO", help="SLOs as ttft:MS tpot:MS e2e:MS")
    g.add_argument("--result-json", default=None, metavar="FILE", help="write the summary and every request's record")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="latency CDFs and throughput over time")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


# --------------------------------------------------------------------------------------------
# SSE


def parse_sse_line(line: bytes | str) -> Any:
    """One SSE line -> None (blank, comment such as `: ping`, or non-data field), "[DONE]", or the
    decoded JSON of a `data:` line. Raises ValueError on a data line that is not JSON."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    line = line.rstrip("\r\n")
    if not line or line.startswith(":"):
        return None
    if not line.startswith("data:"):
        return None  # event:, id:, retry:
    payload = line[5:]
    if payload.startswith(" "):
        payload = payload[1:]
    if payload.strip() == "[DONE]":
        return "[DONE]"
    try:
        return json.loads(payload)
    except json.JSONDecodeError as e:
        raise ValueError(f"bad SSE data line: {payload[:200]!r}") from e


async def iter_sse_lines(stream) -> Any:
    """Lines of an aiohttp response body, split on newlines whatever the chunk boundaries."""
    buf = b""
    async for chunk in stream.iter_any():
        buf += chunk
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                break
            line, buf = buf[:nl], buf[nl + 1 :]
            yield line
    if buf:
        yield buf


def chunk_text(obj: dict, chat: bool) -> str:
    """The generated text a streamed chunk carries ("" if none)."""
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0] or {}
    if chat:
        delta = c.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return c.get("text") or ""


def chunk_error(obj: dict) -> str | None:
    """An error object sent inside the stream, as a message."""
    err = obj.get("error")
    if err:
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    if obj.get("object") == "error":
        return str(obj.get("message") or obj)
    return None


# --------------------------------------------------------------------------------------------
# one request


def build_payload(req: datasets.SampleRequest, model: str, endpoint: str, args) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if endpoint == CHAT:
        if not isinstance(req.prompt, str):
            raise ValueError("the chat endpoint needs text prompts (random sets: --prompt-format text; JSONL: string prompts)")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


async def send_request(session, url: str, headers: dict, body: bytes, rec: RequestRecord, chat: bool, t0: float) -> None:
    """POST one streaming request (`body`: the JSON bytes) and fill `rec` in place."""
    import aiohttp

    start = time.perf_counter()
    rec.start = start - t0
    rec.sent = True
    last = None
    chunks = 0
    usage = None
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            rec.http_status = resp.status
            if resp.status != 200:
                text = (await resp.text(errors="replace"))[:ERROR_BODY_CHARS]
                rec.error = f"HTTP {resp.status}: {text.strip()}"
                return
            async for line in iter_sse_lines(resp.content):
                obj = parse_sse_line(line)
                if obj is None:
                    continue
                if obj == "[DONE]":
                    break
                if not isinstance(obj, dict):
                    continue
                if (msg := chunk_error(obj)) is not None:
                    rec.error = f"stream error: {msg[:ERROR_BODY_CHARS]}"
                    return
                if obj.get("usage"):
                    usage = obj["usage"]
                if chunk_text(obj, chat):
                    now = time.perf_counter()
                    if last is None:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
                    chunks += 1
        rec.e2e = time.perf_counter() - start
    except asyncio.TimeoutError:
        rec.error = "timeout: no complete answer within --request-timeout"
        return
    except aiohttp.ClientError as e:
        rec.error = f"{type(e).__name__}: {e}"
        return
    except ValueError as e:
        rec.error = str(e)
        return
    finally:
        rec.end = time.perf_counter() - t0
    if usage and isinstance(usage.get("completion_tokens"), int):
        rec.output_len = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            rec.prompt_len = usage["prompt_tokens"]
        rec.usage_reported = True
    else:
        rec.output_len = chunks
    if rec.ttft is None:
        rec.error = "no generated text in the stream"
        return
    rec.success = True


# --------------------------------------------------------------------------------------------
# the run


def arrival_delays(n: int, rate: float, arrival: str, burstiness: float, seed: int) -> np.ndarray:
    """Seconds to wait before each request (the first goes at once)."""
    if n <= 0:
        return np.zeros(0)
    if not math.isfinite(rate):
        return np.zeros(n)
    if rate <= 0:
        raise ValueError("--request-rate must be > 0")
    if arrival == "constant":
        gaps = np.full(n, 1.0 / rate)
    else:
        if burstiness <= 0:
            raise ValueError("--burstiness must be > 0")
        rng = np.random.default_rng(seed + 1)  # apart from the prompts' stream
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return gaps


def auth_headers(api_key: str | None) -> dict:
    key = api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def fetch_model_info(session, base_url: str, headers: dict) -> dict:
    async with session.get(f"{base_url}/v1/models", headers=headers) as resp:
        if resp.status != 200:
            hint = " (pass the server's key with --api-key)" if resp.status in (401, 403) else " (pass --model)"
            raise RuntimeError(f"GET /v1/models: HTTP {resp.status}: {(await resp.text())[:ERROR_BODY_CHARS]}{hint}")
        data = (await resp.json()).get("data") or []
    if not data:
        raise RuntimeError("GET /v1/models lists no model")
    return data[0]


async def run_benchmark(
    requests: list[datasets.SampleRequest],
    *,
    base_url: str,
    model: str,
    endpoint: str,
    args,
    headers: dict | None = None,
) -> tuple[list[RequestRecord], float, bool]:
    """Send every request on the schedule; return (records, duration s, stopped by --timeout)."""
    import aiohttp

    url = base_url.rstrip("/") + endpoint
    chat = endpoint == CHAT
    headers = {**(headers or {}), "Content-Type": "application/json"}
    records = [
        RequestRecord(index=i, prompt_len=r.prompt_len, expected_output_len=r.output_len) for i, r in enumerate(requests)
    ]
    delays = arrival_delays(len(requests), args.request_rate, args.arrival, args.burstiness, args.seed)
    # serialised up front: bad configurations fail before any send, and no JSON work at send time
    bodies = [json.dumps(build_payload(r, model, endpoint, args)).encode() for r in requests]
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    pbar = None
    if not args.disable_tqdm:
        from tqdm import tqdm

        pbar = tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr)

    conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, force_close=False)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    end_times: list[float] = []
    send_at = np.cumsum(delays)
    t0 = time.perf_counter()

    async with aiohttp.ClientSession(connector=conn, timeout=timeout, trust_env=False) as session:

        async def send(i: int) -> None:
            try:
                await send_request(session, url, headers, bodies[i], records[i], chat, t0)
            except Exception as e:  # anything unforeseen fails this request, not the run
                records[i].error = f"{type(e).__name__}: {e}"
                records[i].success = False

        async def one(i: int) -> None:
            if sem is None:
                await send(i)
            else:
                async with sem:
                    await send(i)
            end_times.append(time.perf_counter())
            if pbar is not None:
                pbar.update(1)

        async def schedule() -> None:
            tasks = []
            try:
                for i, at in enumerate(send_at):
                    wait = t0 + at - time.perf_counter()  # absolute schedule: sleeps don't drift
                    if wait > 0:
                        await asyncio.sleep(wait)
                    tasks.append(asyncio.create_task(one(i)))
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        timed_out = False
        try:
            await asyncio.wait_for(schedule(), timeout=args.timeout)
        except asyncio.TimeoutError:
            timed_out = True
    if pbar is not None:
        pbar.close()
    end = time.perf_counter() if timed_out or not end_times else max(end_times)
    for r in records:
        if not r.success and r.error is None:
            r.error = "stopped by --timeout before it finished" if r.sent else "not sent before --timeout"
        if r.sent and r.end is None:  # still in flight when --timeout stopped the run
            r.end = end - t0
    return records, end - t0, timed_out


def make_requests(args, vocab_size: int, as_text: bool) -> list[datasets.SampleRequest]:
    common = dict(range_ratio=args.random_range_ratio, vocab_size=vocab_size, as_text=as_text, seed=args.seed)
    if args.dataset == "random":
        return datasets.random_dataset(args.num_prompts, args.random_input_len, args.random_output_len, **common)
    if args.dataset == "shared-prefix":
        return datasets.shared_prefix_dataset(
            args.num_prompts,
            args.shared_prefix_len,
            args.random_input_len,
            args.random_output_len,
            num_groups=args.shared_prefix_num_groups,
            **common,
        )
    if os.path.isfile(args.dataset):
        return datasets.jsonl_dataset(args.dataset, args.num_prompts, args.random_output_len)
    raise ValueError(f"--dataset {args.dataset!r}: not random, shared-prefix or an existing .jsonl file")


def config_dict(args, model: str, vocab_size: int, prompt_format: str) -> dict:
    rate = args.request_rate
    return {
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "shared_prefix_len": args.shared_prefix_len,
        "shared_prefix_num_groups": args.shared_prefix_num_groups,
        "prompt_format": prompt_format,
        "vocab_size": vocab_size,
        "request_rate": "inf" if not math.isfinite(rate) else rate,
        "arrival": args.arrival,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "seed": args.seed,
        "timeout_s": args.timeout,
        "request_timeout_s": args.request_timeout,
        "goodput": args.goodput,
    }


def validate(args) -> None:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.random_output_len < 1:
        raise ValueError("--random-output-len must be >= 1")
    if args.random_input_len < 1 and args.dataset == "random":
        raise ValueError("--random-input-len must be >= 1")
    if args.timeout <= 0 or args.request_timeout <= 0:
        raise ValueError("--timeout and --request-timeout must be > 0")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0")


async def _main(args) -> int:
    import aiohttp

    validate(args)
    slos = report.parse_goodput(args.goodput)
    base_url = args.base_url.rstrip("/")
    headers = auth_headers(args.api_key)
    model = args.model
    vocab = args.vocab_size
    if model is None or vocab is None:
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), trust_env=False) as s:
                info = await fetch_model_info(s, base_url, headers)
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as e:
            if model is None:
                hint = "" if isinstance(e, RuntimeError) else " (pass --model)"
                print(f"error: cannot get the model from {base_url}/v1/models: {e}{hint}", file=sys.stderr)
                return 2
            info = {}
        model = model or info["id"]
        if vocab is None:
            v = info.get("vocab_size")
            vocab = int(v) if isinstance(v, int) and v > datasets.MIN_TOKEN_ID else DEFAULT_VOCAB_FALLBACK
    fmt = args.prompt_format
    if fmt == "auto":
        fmt = "text" if args.endpoint == CHAT else "ids"
    if fmt == "ids" and args.endpoint == CHAT:
        raise ValueError("--prompt-format ids needs --endpoint /v1/completions")
    requests = make_requests(args, vocab, fmt == "text")
    config = config_dict(args, model, vocab, fmt)

    rate = "inf" if not math.isfinite(args.request_rate) else f"{args.request_rate:g} req/s ({args.arrival})"
    print(
        f"bench serve: {len(requests)} requests to {base_url}{args.endpoint}, model {model}, "
        f"dataset {args.dataset}, rate {rate}, max concurrency {args.max_concurrency or 'unbounded'}",
        file=sys.stderr,
    )
    from pagedserve.bench import spec_metrics

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), trust_env=False) as s:
        spec_before = await spec_metrics.scrape(s, base_url, headers)
    records, duration, timed_out = await run_benchmark(
        requests, base_url=base_url, model=model, endpoint=args.endpoint, args=args, headers=headers
    )
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), trust_env=False) as s:
        spec = spec_metrics.summarize(spec_before, await spec_metrics.scrape(s, base_url, headers))
    result = report.build_result(config, records, duration, slos, timed_out=timed_out)
    if spec is not None:  # the server speculates and says how well
        result["spec_decode"] = spec
    print(report.format_table(result))
    if spec is not None:
        print(spec_metrics.format_lines(spec))
    if (why := report.failure_line(result)) is not None:
        print(why, file=sys.stderr)
    if args.result_json:
        report.write_json(result, args.result_json)
        print(f"result JSON: {args.result_json}", file=sys.stderr)
    if args.plot:
        report.plot(result, records, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0 if result["summary"]["failed"] == 0 else 1


def run(args) -> int:
    """Entry for `pagedserve bench serve`: 0 if every request succeeded, 1 if some failed, 2 on a
    configuration error."""
    try:
        return asyncio.run(_main(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
