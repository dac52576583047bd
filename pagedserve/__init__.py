"""pagedserve: an LLM inference and serving engine (paged KV cache, continuous batching)."""
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
