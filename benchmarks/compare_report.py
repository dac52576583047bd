"""Summarise a benchmarks/compare_vllm_cpu.sh sweep: medians, ratios, a JSON, a PNG and a table.

Reads the per-run JSONs of one run folder -- `pagedserve bench throughput` output for ours,
benchmarks/vllm_cpu_runner.py output for vLLM, and the start-up JSONs of both -- and writes
<out-dir>/compare_vllm_cpu_<model>_<dtype>.json and .png. Runs with the project venv (matplotlib).

    python benchmarks/compare_report.py --run-dir /tmp/compare_vllm_cpu/small_float32 --model small --dtype float32
    python benchmarks/compare_report.py --line RUN.json     # one progress line for one run
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

ENGINE_ORDER = ["pagedserve", "vllm-cpu"]


def load_run(path: str) -> dict:
    """One run, in the common shape, whichever engine wrote it."""
    with open(path) as f:
        d = json.load(f)
    if "mode" not in d and "pagedserve" in d:  # `pagedserve bench throughput --output-json`
        p = d["pagedserve"]
        d = {"mode": "throughput", "engine": "pagedserve", "binding": "default", "dtype": d["dtype"],
             "workload": d["workload"], "enable_prefix_caching": d["enable_prefix_caching"],
             "num_requests": d["requests"], "prompt_tokens": d["prompt_tokens"],
             "output_tokens": d["output_tokens"], "wall_s": p["seconds_median"],
             "output_tokens_per_s": p["output_tokens_per_s"], "total_tokens_per_s": p["total_tokens_per_s"],
             "load_s": d["load_seconds"], "threads": d["threads"],
             "prefix_cache_hit_tokens": p["prefix_cache_hit_tokens"]}
    if d.get("binding") == "auto":  # VLLM_CPU_OMP_THREADS_BIND unset: vLLM's own default
        d["binding"] = "default"
    d["file"] = os.path.basename(path)
    return d


def workload_label(r: dict) -> str:
    return r["workload"] + ("" if r.get("enable_prefix_caching", True) else " cache off")


def engine_label(engine: str, binding: str) -> str:
    if engine == "pagedserve":
        return "pagedserve"
    return f"vLLM-CPU {'default bind' if binding == 'default' else 'bind ' + binding}"


def _key(r):
    return (r["engine"], r["binding"], r["dtype"], workload_label(r))


def _sort_key(k):
    engine, binding = k[0], k[1]
    return (k[3], ENGINE_ORDER.index(engine) if engine in ENGINE_ORDER else 9, binding != "default", binding)


def summarise(runs: list[dict]) -> dict:
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r["mode"] == "throughput":
            groups.setdefault(_key(r), []).append(r)
    rows = []
    for k in sorted(groups, key=_sort_key):
        g = groups[k]
        tokens = {(r["prompt_tokens"], r["output_tokens"]) for r in g}
        rows.append({
            "engine": k[0], "binding": k[1], "dtype": k[2], "workload": k[3], "runs": len(g),
            "num_requests": g[0]["num_requests"], "prompt_tokens": g[0]["prompt_tokens"],
            "output_tokens": g[0]["output_tokens"],
            "wall_s_median": statistics.median(r["wall_s"] for r in g),
            "wall_s_all": [round(r["wall_s"], 3) for r in g],
            "output_tokens_per_s_median": statistics.median(r["output_tokens_per_s"] for r in g),
            "total_tokens_per_s_median": statistics.median(r["total_tokens_per_s"] for r in g),
            "load_s_median": statistics.median(r["load_s"] for r in g),
            "prefix_cache_hit_tokens": g[-1].get("prefix_cache_hit_tokens"),
            "token_counts_differ_between_runs": len(tokens) > 1,
        })
    # ours / vLLM, per workload: against each binding and against vLLM's best binding
    for wl in {r["workload"] for r in rows}:
        ours = [r for r in rows if r["workload"] == wl and r["engine"] == "pagedserve"]
        theirs = [r for r in rows if r["workload"] == wl and r["engine"] != "pagedserve"]
        if not ours or not theirs:
            continue
        o = ours[0]
        for t in theirs:
            t["ours_over_this_output_tok_s"] = o["output_tokens_per_s_median"] / t["output_tokens_per_s_median"]
            t["ours_over_this_total_tok_s"] = o["total_tokens_per_s_median"] / t["total_tokens_per_s_median"]
        best = max(theirs, key=lambda t: t["output_tokens_per_s_median"])
        o["vllm_best_binding"] = best["binding"]
        o["ours_over_vllm_best_output_tok_s"] = o["output_tokens_per_s_median"] / best["output_tokens_per_s_median"]
        o["ours_over_vllm_best_total_tok_s"] = o["total_tokens_per_s_median"] / best["total_tokens_per_s_median"]

    st_groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r["mode"] == "startup":
            st_groups.setdefault((r["engine"], r["binding"], r["dtype"]), []).append(r)
    startup = [{"engine": k[0], "binding": k[1], "dtype": k[2], "runs": len(g),
                "startup_s_median": statistics.median(r["startup_s"] for r in g),
                "startup_s_all": [round(r["startup_s"], 2) for r in g]}
               for k, g in sorted(st_groups.items(), key=lambda kv: _sort_key((*kv[0], "")))]
    return {"throughput": rows, "startup": startup}


def markdown(summary: dict) -> str:
    out = ["| engine | binding | dtype | workload | wall s | out tok/s | total tok/s | ours ÷ this (out tok/s) |",
           "|---|---|---|---|---:|---:|---:|---:|"]
    for r in summary["throughput"]:
        if r["engine"] == "pagedserve":
            ratio = (f"{r['ours_over_vllm_best_output_tok_s']:.2f}× vs best vLLM ({r['vllm_best_binding']})"
                     if "ours_over_vllm_best_output_tok_s" in r else "")
        else:
            ratio = f"{r['ours_over_this_output_tok_s']:.2f}×" if "ours_over_this_output_tok_s" in r else ""
        out.append(f"| {r['engine']} | {r['binding']} | {r['dtype']} | {r['workload']} | {r['wall_s_median']:.2f} | "
                   f"{r['output_tokens_per_s_median']:.1f} | {r['total_tokens_per_s_median']:.1f} | {ratio} |")
    if summary["startup"]:
        out += ["", "| engine | binding | dtype | start-up s (process start → first token), median | all runs |",
                "|---|---|---|---:|---|"]
        for s in summary["startup"]:
            out.append(f"| {s['engine']} | {s['binding']} | {s['dtype']} | {s['startup_s_median']:.1f} | "
                       f"{', '.join(f'{x:.1f}' for x in s['startup_s_all'])} |")
    return "\n".join(out)


def plot(summary: dict, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["throughput"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    series = list(dict.fromkeys((r["engine"], r["binding"]) for r in rows))
    # (median field, axis label, ratio field shown under each workload)
    panels = [("output_tokens_per_s_median", "output tok/s", "ours_over_vllm_best_output_tok_s"),
              ("total_tokens_per_s_median", "total tok/s", "ours_over_vllm_best_total_tok_s")]
    n = len(panels) + (1 if summary["startup"] else 0)
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4.5), squeeze=False)
    width = 0.8 / max(1, len(series))
    for ax, (field, ylabel, ratio_field) in zip(axes[0], panels):
        for i, (engine, binding) in enumerate(series):
            vals = [next((r[field] for r in rows if r["workload"] == w and (r["engine"], r["binding"]) == (engine, binding)), 0)
                    for w in workloads]
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(workloads))]
            bars = ax.bar(xs, vals, width, label=engine_label(engine, binding))
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ratios = {r["workload"]: r.get(ratio_field) for r in rows if r["engine"] == "pagedserve"}
        ax.set_xticks(range(len(workloads)),
                      [w + (f"\nours ÷ best\nvLLM: {ratios[w]:.2f}×" if ratios.get(w) else "") for w in workloads],
                      fontsize=8)
        ax.set_ylabel(f"{ylabel} (median)")
        ax.set_title(f"{ylabel}, higher is better")
    axes[0][0].legend(fontsize=8)
    if summary["startup"]:
        ax = axes[0][-1]
        st = summary["startup"]
        bars = ax.bar(range(len(st)), [s["startup_s_median"] for s in st],
                      color=[f"C{series.index((s['engine'], s['binding'])) if (s['engine'], s['binding']) in series else i}"
                             for i, s in enumerate(st)])
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_xticks(range(len(st)), [engine_label(s["engine"], s["binding"]).replace("vLLM-CPU ", "vLLM\n") for s in st],
                      fontsize=8)
        ax.set_ylabel("seconds (median)")
        ax.set_title("start-up to first token, lower is better")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def line(path: str) -> str:
    r = load_run(path)
    who = f"{engine_label(r['engine'], r['binding'])}"
    if r["mode"] == "startup":
        return f"   {who:<24} start-up {r['startup_s']:.1f} s"
    short = "" if r["output_tokens"] == r.get("output_tokens_expected", r["output_tokens"]) else \
        f"  (only {r['output_tokens']} of {r['output_tokens_expected']} output tokens!)"
    return (f"   {who:<24} {workload_label(r):<13} {r['wall_s']:8.2f} s  {r['output_tokens_per_s']:8.1f} out tok/s  "
            f"{r['total_tokens_per_s']:8.1f} total tok/s  (load {r['load_s']:.1f} s){short}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--line", help="print one progress line for this run JSON and exit")
    p.add_argument("--run-dir")
    p.add_argument("--model", default="small")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out-dir", default="benchmarks/results")
    args = p.parse_args()
    if args.line:
        print(line(args.line))
        return 0
    if not args.run_dir:
        p.error("--run-dir is needed")

    files = sorted(glob.glob(os.path.join(args.run_dir, "run_*.json")) + glob.glob(os.path.join(args.run_dir, "startup_*.json")))
    runs = [load_run(f) for f in files]
    if not runs:
        print(f"compare_report: no run JSONs in {args.run_dir}", file=sys.stderr)
        return 1
    summary = summarise(runs)
    machine = ""
    if os.path.exists(os.path.join(args.run_dir, "machine.txt")):
        machine = open(os.path.join(args.run_dir, "machine.txt")).read()
    vllm_runs = [r for r in runs if r["engine"] == "vllm-cpu"]
    result = {
        "model": args.model, "dtype": args.dtype, "machine": machine,
        "settings": {"vllm_version": vllm_runs[0].get("engine_version") if vllm_runs else None,
                     "vllm_ld_preload": vllm_runs[0].get("ld_preload") if vllm_runs else None,
                     "kv_cache_space_gib": vllm_runs[0].get("kv_cache_space_gib") if vllm_runs else None,
                     "pagedserve_threads": next((r["threads"] for r in runs if r["engine"] == "pagedserve" and "threads" in r), None),
                     "notes": "wall_s times the generate call only (model load and a small warm-up excluded; "
                              "prefix cache reset before it). Start-up is process start to the first token of a "
                              "1-token request. Medians over alternated runs, each in its own process."},
        **summary,
        "runs": runs,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"compare_vllm_cpu_{args.model}_{args.dtype}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=2)
    n_req = sorted({r["num_requests"] for r in summary["throughput"]})
    plot(summary, f"pagedserve vs vLLM-CPU {result['settings']['vllm_version'] or ''}: model {args.model}, "
                  f"{args.dtype}, requests per workload {n_req}", base + ".png")
    print(markdown(summary))
    print(f"\nwrote {base}.json and {base}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
