import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
torch_threads = int(os.environ.get("PAGEDSERVE_TEST_THREADS", "0"))
# Engines here leave their CPU KV pools lazily faulted instead of making them resident in the
# background: dozens of test engines with multi-GiB pools would otherwise hold that memory.
# tests/test_kv_memory.py covers the populating path.
os.environ.setdefault("PAGEDSERVE_POPULATE_KV", "0")

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", num_kv_heads=1)


@pytest.fixture(scope="session")
def shared_models():
    d = SHARED / "models"
    if not (d / "stories260K").is_dir():
        pytest.skip(f"real test models not present at {d} (only the project's own CI and dev machines have ../shared)")
    return d
