"""The whole engine on the CPU with the Triton attention backend (Triton's interpreter).

Greedy token ids must equal transformers and the torch backend, over a batch that mixes decodes,
first prefill chunks and later chunks of a chunked prefill (small max_num_batched_tokens).
"""
import pytest
import torch

from hf_reference import hf_greedy, random_prompts
from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.errors import ConfigError
from pagedserve.attention import select_backend
from pagedserve.kernels.triton import paged_attention as tk

GREEDY = dict(temperature=0.0, ignore_eos=True)
# the 1- and 6-token prompts decode while the 41-token one is still prefilling in chunks
LENGTHS = [1, 41, 6, 19]
MAX_TOKENS = 4


@pytest.fixture
def triton_env(monkeypatch):
    if not tk.triton_available():
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "triton")
    kind = type(tk._kernels()["store_kv"]).__name__
    if kind != "InterpretedFunction":
        pytest.skip(f"the Triton kernels were already built as {kind} in this process (not for the interpreter); "
                    "run with TRITON_INTERPRET=1 in the environment")


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=MAX_TOKENS, **GREEDY))
    return [o.outputs[0].token_ids for o in outs]


def test_engine_triton_backend_matches_hf_and_torch(llama_dir, triton_env, monkeypatch):
    kw = dict(model=str(llama_dir), max_num_batched_tokens=24, max_num_seqs=8, num_gpu_blocks_override=64,
              block_size=16, device="cpu")
    llm = LLM(**kw)
    eng = llm.llm_engine
    assert eng.runner.backend.name == "triton"
    assert eng.runner.backend.needs_block_tables
    prompts = random_prompts(len(LENGTHS), eng.spec.vocab_size, LENGTHS, seed=11)

    steps = []
    orig_prepare = eng.runner._prepare

    def spy(entries):
        out = orig_prepare(entries)
        meta = out[2]
        steps.append((meta.num_decode_tokens, [(p.q_end - p.q_start, p.context_len) for p in meta.prefills]))
        return out

    eng.runner._prepare = spy
    got = _generate(llm, prompts)
    # the schedule did exercise every path: pure decode, mixed, and a later prefill chunk
    assert any(nd and pf for nd, pf in steps), steps
    assert any(nd and not pf for nd, pf in steps), steps
    assert any(ctx > n for _, pf in steps for n, ctx in pf), steps
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks

    for p, ids in zip(prompts, got):
        assert ids == hf_greedy(str(llama_dir), tuple(p), MAX_TOKENS), f"prompt of {len(p)} tokens"

    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "torch")
    ref = LLM(**kw)
    assert ref.llm_engine.runner.backend.name == "torch-sdpa"
    assert _generate(ref, prompts) == got


def test_select_backend_choice(monkeypatch):
    assert select_backend("cpu", 16, choice="torch").name == "torch-sdpa"
    assert not getattr(select_backend("cpu", 16, choice="torch"), "needs_block_tables", False)
    assert select_backend("cpu", 16, torch.float16).name == "torch-sdpa"  # no native kernel for float16
    assert select_backend("cpu", 16, cpu_kernels=False).name == "torch-sdpa"
    with pytest.raises(ConfigError, match="kernels are off"):
        select_backend("cpu", 16, choice="cpu", cpu_kernels=False)
    with pytest.raises(ConfigError, match="flash-attn is not available"):
        select_backend("cpu", 16, choice="flash-attn")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="CUDA device"):
        select_backend("cpu", 16, choice="triton")
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "nonsense")
    with pytest.raises(ConfigError, match="auto, cpu, torch, triton, flash-attn"):
        EngineConfig().validate_static()
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "flash_attn")
    cfg = EngineConfig()
    cfg.validate_static()
    assert cfg.attention_backend == "flash-attn"


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: replay re-runs the forward on the static buffers."""

    replays = 0

    def __init__(self, fn, inputs, out):
        self.fn, self.inputs, self.out = fn, inputs, out

    def replay(self):
        _FakeGraph.replays += 1
        self.out.copy_(self.fn(**self.inputs))


def test_decode_graph_path_pads_and_matches(llama_dir, triton_env):
    """The CUDA-graph decode path minus the device: static buffers, padding rows (slot -1, seq_len 0)
    and slicing, through the Triton kernels, must give the same greedy tokens as eager."""
    prompts = random_prompts(3, 384, [3, 9, 20], seed=5)  # 3 decodes pad to the graph for 4
    kw = dict(model=str(llama_dir), max_num_seqs=4, num_gpu_blocks_override=32, max_model_len=256, device="cpu")
    eager = _generate(LLM(**kw), prompts)
    assert eager == [hf_greedy(str(llama_dir), tuple(p), MAX_TOKENS) for p in prompts]

    llm = LLM(**kw)
    runner = llm.llm_engine.runner
    runner.enable_cuda_graphs(4, 256, capture=False)
    g = runner.graphs.graphs
    assert g.ladder == [1, 2, 4]
    with torch.inference_mode():
        for bs in g.ladder:  # what capture() records, minus the device: an all-padding forward
            inputs = g._static_view(bs)
            out = g.forward_fn(**inputs)
            assert torch.isfinite(out).all()
            g._graphs[bs], g._outputs[bs] = _FakeGraph(g.forward_fn, inputs, out), out
    _FakeGraph.replays = 0
    assert _generate(llm, prompts) == eager
    assert _FakeGraph.replays >= MAX_TOKENS - 1  # the decode steps went through the graphs
