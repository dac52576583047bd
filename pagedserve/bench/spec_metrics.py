"""Speculative decoding's acceptance, read from the server's /metrics before and after a run.

Any server that exports vLLM's spec_decode_* counters counts (the `pagedserve:` or `vllm:` prefix);
a server without them, or without /metrics, gives None and the report says nothing about it.
"""
from __future__ import annotations

_NAMES = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def parse(text: str) -> dict[str, float] | None:
    """The spec_decode_* counter totals in a Prometheus text exposition (summed over labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        base = fam.name.split(":")[-1]
        if base in _NAMES:
            out[base] = out.get(base, 0.0) + sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return out if len(out) == len(_NAMES) else None


async def scrape(session, base_url: str, headers: dict) -> dict[str, float] | None:
    try:
        async with session.get(f"{base_url}/metrics", headers=headers) as resp:
            if resp.status != 200:
                return None
            return parse(await resp.text())
    except Exception:  # no /metrics, or not Prometheus text: nothing to report
        return None


def summarize(before: dict | None, after: dict | None) -> dict | None:
    """Acceptance over the run: rate and mean acceptance length (accepted drafts + 1 per verification)."""
    if not before or not after:
        return None
    d = {k: after[k] - before[k] for k in _NAMES}
    drafts, drafted, accepted = d["spec_decode_num_drafts"], d["spec_decode_num_draft_tokens"], d[
        "spec_decode_num_accepted_tokens"]
    if drafts <= 0:
        return None
    return {"num_drafts": int(drafts), "num_draft_tokens": int(drafted), "num_accepted_tokens": int(accepted),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": 1.0 + accepted / drafts}


def format_lines(s: dict) -> str:
    return (f"Draft acceptance rate (%):               {100.0 * s['acceptance_rate']:.2f}\n"
            f"Mean acceptance length:                  {s['mean_acceptance_length']:.2f}\n"
            f"Drafted / accepted tokens:               {s['num_draft_tokens']} / {s['num_accepted_tokens']}")
