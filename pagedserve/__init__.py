"""pagedserve: an LLM inference and serving engine (paged KV cache, continuous batching)."""
import os

# OpenMP threads that spin at barriers collapse when another process takes a core: W1 (64
# requests, 2 cores, one core held by a busy loop) took 59.6 s spinning vs 39.6 s passive, and the
# same when alone (25.5 vs 25.3 s median). libgomp reads this when torch loads it, so it is set
# here, before torch is imported; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
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
