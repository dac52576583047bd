"""pagedserve: an LLM inference and serving engine (paged KV cache, continuous batching)."""
import os

# How long idle OpenMP threads spin before they sleep. Spinning without end (OMP_WAIT_POLICY=active)
# collapses when another process takes a core: W1 (64 requests, 2 cores, a busy loop on one) took
# 59.6 s vs 39.6 s passive. Sleeping at once (passive) pays a futex wake-up under the hypervisor
# for each of the ~200 parallel regions of a step: W1-64 alone took 21.8-23.5 s passive vs
# 16.5-17.0 s with a short spin. About 2000 spins (~20 us) covers the gaps between ops within a
# step and still yields the core quickly: with the busy loop, 26.7-30.4 s vs passive 24.8-29.0 s.
# libgomp reads these when torch loads it, so they are set here, before torch is imported; a
# user's own setting of either wins.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "2000"
from pagedserve.config import EngineConfig
from pagedserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "__version__"]


def __getattr__(name):
    # LLM pulls in torch; import it lazily so light commands (plan, bench serve) stay fast
    if name == "LLM":
        from pagedserve.llm import LLM

        return LLM
    raise AttributeError(name)
