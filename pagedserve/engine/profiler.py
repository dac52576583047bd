"""Per-phase wall time of engine steps (`bench throughput --profile`): where a step's time goes."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

PHASES = ("schedule", "prepare_inputs", "forward", "logits", "sample", "postprocess")
MODEL_PHASES = ("forward", "logits")  # the model's own compute: decoder layers, then the LM head


class StepProfiler:
    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.seqs = 0

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - t0

    def report(self) -> str:
        total = sum(self.totals.values()) or 1e-9
        lines = [f"per-phase time over {self.steps} steps (mean batch {self.seqs / max(self.steps, 1):.1f} sequences):"]
        for name in PHASES:
            t = self.totals.get(name, 0.0)
            lines.append(f"  {name:<15} {t:8.3f} s  {100 * t / total:5.1f} %  {1000 * t / max(self.steps, 1):7.2f} ms/step")
        outside = total - sum(self.totals.get(name, 0.0) for name in MODEL_PHASES)
        lines.append(f"  engine overhead (all but forward and logits): {100 * outside / total:.1f} % of step time")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"steps": self.steps, "seconds": dict(self.totals)}


class _NullPhase:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


NULL_PHASE = _NullPhase()
