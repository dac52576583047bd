"""Device-independent halves of the CUDA fast path: graph ladder and padding, KV-cache budget math."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.errors import ConfigError
from pagedserve.runner.cuda_graphs import CudaGraphRunner, capture_sizes, padded_batch_size
from pagedserve.runner.memory_profile import GiB, kv_bytes_per_block, plan_kv_cache, profile_peak_memory

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- ladder / padding


def test_capture_sizes_ladder():
    assert capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 8))
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]  # max_num_seqs itself always gets a graph
    assert capture_sizes(1024)[-1] == 512
    assert capture_sizes(1024) == capture_sizes(512)
    assert capture_sizes(100, max_capture_size=32) == [1, 2, 4, 8, 16, 24, 32]
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_padded_batch_size():
    ladder = capture_sizes(40)
    assert [padded_batch_size(n, ladder) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 40)] == [
        1, 2, 4, 4, 8, 8, 16, 16, 24, 40, 40,
    ]
    assert padded_batch_size(41, ladder) is None  # above the ladder: run eager
    assert padded_batch_size(600, capture_sizes(1000)) is None
    with pytest.raises(ValueError):
        padded_batch_size(0, ladder)


def test_every_batch_up_to_max_num_seqs_has_a_graph():
    for max_num_seqs in (1, 7, 64, 100, 512):
        ladder = capture_sizes(max_num_seqs)
        for n in range(1, max_num_seqs + 1):
            bs = padded_batch_size(n, ladder)
            assert bs is not None and n <= bs <= max_num_seqs
            assert bs - n < 8 or n <= 8


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: replay recomputes from the static buffers."""

    def __init__(self, fn, inputs, out):
        self.fn, self.inputs, self.out = fn, inputs, out

    def replay(self):
        self.out.copy_(self.fn(**self.inputs))


def test_graph_runner_stages_pads_and_slices_on_cpu():
    N, W = 8, 4
    static = {
        "input_ids": torch.zeros(N, dtype=torch.long),
        "slot_mapping": torch.zeros(N, dtype=torch.long),
        "seq_lens": torch.zeros(N, dtype=torch.int32),
        "block_tables": torch.zeros(N, W, dtype=torch.int32),
    }

    def fn(input_ids, slot_mapping, seq_lens, block_tables):
        return input_ids * 1000 + slot_mapping * 10 + seq_lens + block_tables.sum(1)

    runner = CudaGraphRunner(fn, static, capture_sizes(N), pad_values={"slot_mapping": -1})
    assert runner.replay({k: v[:3] for k, v in static.items()}) is None  # nothing captured yet
    for bs in runner.ladder:  # what capture() records, minus the device
        inputs = runner._static_view(bs)
        out = fn(**inputs)
        runner._graphs[bs] = _FakeGraph(fn, inputs, out)
        runner._outputs[bs] = out

    live = {
        "input_ids": torch.tensor([1, 2, 3]),
        "slot_mapping": torch.tensor([5, 6, 7]),
        "seq_lens": torch.tensor([9, 8, 7], dtype=torch.int32),
        "block_tables": torch.tensor([[1, 2], [3, 0], [4, 4]], dtype=torch.int32),  # narrower than W
    }
    out = runner.replay(live)
    assert out.shape == (3,)
    torch.testing.assert_close(out, fn(**live))
    # the graph for 4 ran: its padding row has slot -1 and zeros elsewhere
    assert static["slot_mapping"][:4].tolist() == [5, 6, 7, -1]
    assert static["input_ids"][:4].tolist() == [1, 2, 3, 0]
    assert static["block_tables"][:4].tolist() == [[1, 2, 0, 0], [3, 0, 0, 0], [4, 4, 0, 0], [0, 0, 0, 0]]
    # stale values from a bigger earlier batch are overwritten by padding
    big = {k: torch.ones_like(v[:8]) for k, v in static.items()}
    torch.testing.assert_close(runner.replay(big), fn(**big))
    out = runner.replay({k: v[:1] for k, v in live.items()})
    torch.testing.assert_close(out, fn(**{k: v[:1] for k, v in live.items()}))
    assert runner.replay({k: torch.zeros((9,) + v.shape[1:], dtype=v.dtype) for k, v in static.items()}) is None


def test_graph_runner_rejects_mismatched_inputs():
    static = {"a": torch.zeros(4), "b": torch.zeros(4, 2)}
    with pytest.raises(ValueError, match="smaller than the largest"):
        CudaGraphRunner(lambda **kw: None, static, [1, 2, 8])
    with pytest.raises(ValueError, match="unknown"):
        CudaGraphRunner(lambda **kw: None, static, [1, 2, 4], pad_values={"c": 0})
    runner = CudaGraphRunner(lambda **kw: None, static, [1, 2, 4])
    with pytest.raises(ValueError, match="missing"):
        runner.stage_inputs(4, {"a": torch.zeros(2)})
    with pytest.raises(ValueError, match="disagree"):
        runner.stage_inputs(4, {"a": torch.zeros(2), "b": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="does not fit"):
        runner.stage_inputs(4, {"a": torch.zeros(2), "b": torch.zeros(2, 3)})
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            runner.capture()


# ---------------------------------------------------------------- memory budget


def test_kv_bytes_per_block():
    # Llama-3-8B-like: 32 layers, 8 kv heads, head_dim 128, fp16, block 16 -> 2 MiB per block
    assert kv_bytes_per_block(32, 16, 8, 128, 2) == 2 * 1024 * 1024


def _plan(**overrides):
    args = dict(
        total_memory=80 * GiB,
        gpu_memory_utilization=0.9,
        weights_bytes=16 * GiB,
        peak_activation_bytes=2 * GiB,
        non_torch_bytes=GiB,
        kv_bytes_per_block=2 * 1024 * 1024,
        block_size=16,
        max_model_len=8192,
        max_num_seqs=256,
    )
    args.update(overrides)
    return plan_kv_cache(**args)


def test_plan_kv_cache_numbers_and_summary():
    plan = _plan()
    # budget 72 GiB - 19 GiB fixed = 53 GiB of 2 MiB blocks
    assert plan.num_blocks == 53 * 512
    assert plan.kv_cache_bytes == 53 * GiB
    assert plan.max_concurrency == pytest.approx(53 * 512 * 16 / 8192)
    for part in ("weights 16.00 GiB", "activations 2.00 GiB", "other 1.00 GiB", "KV cache 53.00 GiB",
                 "27136 blocks", "53.00x"):
        assert part in plan.summary, (part, plan.summary)


def test_plan_kv_cache_floor_and_exact_fit():
    # exactly one max_model_len sequence: fits, concurrency 1.0
    bpb = 1024
    plan = _plan(total_memory=1000 * bpb, gpu_memory_utilization=1.0, weights_bytes=0, peak_activation_bytes=0,
                 non_torch_bytes=500 * bpb + 7, kv_bytes_per_block=bpb, max_model_len=499 * 16)
    assert plan.num_blocks == 499  # 500 blocks minus the 7 stray bytes, floored
    assert plan.max_concurrency == pytest.approx(1.0)


def test_plan_kv_cache_too_small_suggests_both_fixes():
    # budget 0.5 * 40 GiB = 20 GiB; fixed 19 GiB leaves 1 GiB = 512 blocks = 8192 tokens < 32768
    with pytest.raises(ConfigError) as err:
        _plan(total_memory=40 * GiB, gpu_memory_utilization=0.5, max_model_len=32768)
    msg = str(err.value)
    assert "estimated maximum model length that fits: 8192" in msg
    assert "lower --max-model-len to 8192" in msg
    # needs 19 GiB + 2048 blocks * 2 MiB = 23 GiB of 40 -> 0.575 -> 0.58
    assert "raise --gpu-memory-utilization to 0.58" in msg
    assert "--max-model-len 32768" in msg and "2048 blocks" in msg and "only 512 fit" in msg
    # the suggested utilization really fits
    plan = _plan(total_memory=40 * GiB, gpu_memory_utilization=0.58, max_model_len=32768)
    assert plan.num_blocks >= 2048
    plan = _plan(total_memory=40 * GiB, gpu_memory_utilization=0.5, max_model_len=8192)
    assert plan.num_blocks == 512


def test_plan_kv_cache_too_small_even_at_full_utilization():
    # weights alone exceed the device: no utilization or length fixes it
    with pytest.raises(ConfigError) as err:
        _plan(total_memory=16 * GiB, weights_bytes=20 * GiB)
    msg = str(err.value)
    assert "estimated maximum model length that fits: 0" in msg
    assert "--gpu-memory-utilization to" not in msg and "lower --max-model-len" not in msg
    assert "smaller or quantized model" in msg
    # utilization cannot pass 1.0: only the length fix is offered
    with pytest.raises(ConfigError) as err:
        _plan(total_memory=20 * GiB, gpu_memory_utilization=0.99, max_model_len=1 << 20)
    msg = str(err.value)
    assert "raise --gpu-memory-utilization" not in msg
    fits = int(msg.split("estimated maximum model length that fits: ")[1].split(".")[0])
    assert fits > 0 and f"lower --max-model-len to {fits}" in msg


def test_plan_kv_cache_rejects_bad_utilization():
    with pytest.raises(ConfigError, match="gpu-memory-utilization"):
        _plan(gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match="gpu-memory-utilization"):
        _plan(gpu_memory_utilization=0)


def test_profile_peak_memory_is_cuda_only():
    with pytest.raises(ValueError, match="CUDA"):
        profile_peak_memory(lambda: None, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profile_peak_memory_measures_activation_peak():
    def forward():
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB transient
        del x

    peak = profile_peak_memory(forward, "cuda")
    assert 64 << 20 <= peak < 80 << 20


# ---------------------------------------------------------------- imports without a GPU / triton


def test_modules_import_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "from pagedserve.kernels.triton import paged_attention as tk\n"
        "import pagedserve.runner.cuda_graphs, pagedserve.runner.memory_profile\n"
        "assert tk.triton_available() is False\n"
        "try:\n"
        "    tk._kernels()\n"
        "except RuntimeError as e:\n"
        "    assert 'triton is not installed' in str(e)\n"
        "else:\n"
        "    raise SystemExit('kernels built without triton')\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


# ---------------------------------------------------------------- the profile batch (CudaModelRunner.num_kv_blocks)


def test_profile_batch_lengths():
    from pagedserve.runner.memory_profile import profile_batch_lengths

    assert profile_batch_lengths(2048, 4096, 256) == [2048]
    assert profile_batch_lengths(2048, 1000, 256) == [683, 683, 682]
    assert profile_batch_lengths(8192, 2048, 2) == [2048, 2048]  # capped by max_num_seqs and max_model_len
    assert profile_batch_lengths(5, 2, 8) == [2, 2, 1]
    for args in [(4096, 300, 64), (100, 7, 256), (1, 1, 1)]:
        lengths = profile_batch_lengths(*args)
        assert len(lengths) <= args[2] and max(lengths) <= args[1]
    with pytest.raises(ValueError):
        profile_batch_lengths(0, 10, 10)


def test_dummy_forward_runs_on_cpu(llama_dir):
    """The device-independent half of the CUDA profile: the dummy batch goes through the real
    batch construction and model on a temporary KV cache of exactly the blocks it needs."""
    from pagedserve import LLM
    from pagedserve.runner import memory_profile as mp
    from pagedserve.runner.kv_cache import KVCache
    from pagedserve.runner.model_runner import ModelRunner

    eng = LLM(model=str(llama_dir), num_gpu_blocks_override=8, max_model_len=128, device="cpu").llm_engine
    lengths = mp.profile_batch_lengths(100, 40, 8)
    entries, blocks = mp.dummy_entries(lengths, 16)
    assert blocks == sum(-(-n // 16) for n in lengths)
    assert [e.seq.block_table for e in entries][:2] == [[0, 1, 2], [3, 4, 5]]
    kv = KVCache(eng.spec, blocks, 16, eng.dtype, eng.device)
    runner = ModelRunner(eng.runner.model, eng.config, eng.device, kv)
    mp.run_dummy_forward(runner, entries, 4)
    assert kv.blocks[0][0].abs().sum() > 0  # K/V were written
