"""`pagedserve plan`: the capacity arithmetic against hand computations, the verdicts, the refusals, the CLI."""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve import plan as planmod

REPO = Path(__file__).resolve().parents[1]

LLAMA2_13B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 5120, "num_hidden_layers": 40,
    "num_attention_heads": 40, "num_key_value_heads": 40, "intermediate_size": 13824, "vocab_size": 32000,
    "torch_dtype": "float16", "max_position_embeddings": 4096, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
}
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    "torch_dtype": "bfloat16", "max_position_embeddings": 8192, "tie_word_embeddings": False,
}
LLAMA3_70B = {
    "model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256, "torch_dtype": "bfloat16",
    "max_position_embeddings": 8192, "tie_word_embeddings": False,
}


def write_config(tmp_path, cfg, name="model"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def parse(*argv):
    parser = argparse.ArgumentParser(prog="pagedserve")
    planmod.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["plan", *map(str, argv)])


def run_json(capsys, *argv):
    rc = planmod.run(parse(*argv, "--json"))
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


def run_fail(capsys, *argv):
    rc = planmod.run(parse(*argv))
    out = capsys.readouterr()
    assert rc == 2
    assert "Traceback" not in out.err
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    return lines[0]


def hand_params(H, L, nh, nkv, I, V, tied, hd=None, qkv_bias=False):
    hd = hd or H // nh
    attn = H * nh * hd + 2 * H * nkv * hd + nh * hd * H
    bias = nh * hd + 2 * nkv * hd if qkv_bias else 0
    mlp = 3 * H * I
    layer = attn + bias + mlp + 2 * H
    return V * H + (0 if tied else V * H) + L * layer + H


def test_llama2_13b_kv_and_params(tmp_path, capsys):
    d = write_config(tmp_path, LLAMA2_13B)
    p = run_json(capsys, "--model", d, "--gpu", "A100-80GB", "--max-model-len", 2048, "--target-concurrency", 10)
    # KV per token: 2 (K,V) x 40 layers x 40 kv heads x 128 head_dim x 2 bytes (fp16)
    assert p["kv_cache"]["bytes_per_token"] == 2 * 40 * 40 * 128 * 2 == 819_200
    # 2048 tokens x 10 sequences ~ 16.8 GB
    kv10 = p["kv_cache"]["bytes_for_target_concurrency"]
    assert kv10 == 819_200 * 2048 * 10
    assert abs(kv10 / 16.8e9 - 1) < 0.01
    params = p["params"]["total"]
    assert params == hand_params(5120, 40, 40, 40, 13824, 32000, tied=False)
    assert abs(params / 13.0e9 - 1) < 0.01
    assert p["weights"]["bytes_total"] == params * 2
    assert p["verdict"]["fits"] is True
    assert p["recommended"]["max_num_seqs"] == 10


def test_llama3_8b_gqa_params_and_weights(tmp_path, capsys):
    d = write_config(tmp_path, LLAMA3_8B)
    p = run_json(capsys, "--model", d / "config.json", "--gpu", "H100-80GB")
    hd = 4096 // 32
    assert p["model"]["head_dim"] == hd == 128
    # KV per token: 2 x 32 layers x 8 kv heads x 128 x 2 bytes (bf16)
    assert p["kv_cache"]["bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131_072
    # embeddings + untied lm_head + 32 x (q, k, v (GQA), o, gate, up, down, 2 norms) + final norm
    emb = 128256 * 4096
    layer = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    hand = 2 * emb + 32 * layer + 4096
    assert p["params"]["total"] == hand == hand_params(4096, 32, 32, 8, 14336, 128256, tied=False)
    assert abs(hand / 8.03e9 - 1) < 0.001
    assert p["weights"]["bytes_total"] == 2 * hand
    assert abs(p["weights"]["bytes_total"] / 16.06e9 - 1) < 0.001
    assert p["settings"]["dtype"] == "bfloat16"
    assert p["settings"]["max_model_len"] == 8192  # from max_position_embeddings
    # memory arithmetic is the documented formula
    m, cap = p["memory"], p["capacity"]
    assert m["kv_budget_bytes"] == pytest.approx(
        m["gpu_bytes"] * 0.9 - m["weights_bytes"] - m["activation_bytes"] - m["overhead_bytes"], abs=2)
    assert cap["num_blocks"] == m["kv_budget_bytes"] // (16 * 131_072)
    assert cap["max_full_length_sequences"] == cap["num_blocks"] // (8192 // 16)
    # decode ceiling: bandwidth / (weights + context x KV per token)
    dec = p["decode"]
    assert dec["single_sequence_tokens_per_s"] == pytest.approx(
        3350e9 / (2 * hand + 8192 * 131_072), abs=0.1)
    n = dec["resident_concurrency"]
    assert n == p["recommended"]["max_num_seqs"]
    assert dec["aggregate_tokens_per_s_at_target"] == pytest.approx(
        n * 3350e9 / (2 * hand + n * 8192 * 131_072), rel=1e-3)


def test_tied_embeddings_qwen2_bias_and_head_dim(tmp_path, capsys):
    cfg = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
           "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True,
           "torch_dtype": "bfloat16", "max_position_embeddings": 32768}
    p = run_json(capsys, "--model", write_config(tmp_path, cfg), "--gpu", "L4")
    assert p["params"]["lm_head"] == 0
    assert p["params"]["total"] == hand_params(896, 24, 14, 2, 4864, 151936, tied=True, qkv_bias=True)
    assert abs(p["params"]["total"] / 494e6 - 1) < 0.01  # Qwen2-0.5B
    cfg2 = dict(LLAMA3_8B, head_dim=256)
    p2 = run_json(capsys, "--model", write_config(tmp_path, cfg2, "hd"), "--gpu", "H200")
    assert p2["kv_cache"]["bytes_per_token"] == 2 * 32 * 8 * 256 * 2


def test_quantized_weights_and_fp8_kv(tmp_path, capsys):
    d = write_config(tmp_path, LLAMA3_8B)
    base = run_json(capsys, "--model", d, "--gpu", "H100")
    emb_bytes = 2 * 128256 * 4096 * 2 + 4096 * 2
    lin = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096)]
    norms = 32 * 2 * 4096 * 2
    i8 = run_json(capsys, "--model", d, "--gpu", "H100", "--quantization", "int8")
    assert i8["weights"]["bytes_total"] == emb_bytes + norms + 32 * sum(a * b + b * 4 for a, b in lin)
    i4 = run_json(capsys, "--model", d, "--gpu", "H100", "--quantization", "int4")
    assert i4["weights"]["bytes_total"] == emb_bytes + norms + 32 * sum(a * b // 2 + b * (a // 128) * 2 for a, b in lin)
    assert i4["weights"]["bytes_total"] < i8["weights"]["bytes_total"] < base["weights"]["bytes_total"]
    assert i4["params"]["total"] == base["params"]["total"]
    kv8 = run_json(capsys, "--model", d, "--gpu", "H100", "--kv-cache-dtype", "fp8")
    assert kv8["kv_cache"]["bytes_per_token"] == 131_072 // 2
    assert kv8["capacity"]["num_blocks"] > 1.9 * base["capacity"]["num_blocks"]


def test_tensor_parallel_splits_weights_and_kv(tmp_path, capsys):
    d = write_config(tmp_path, LLAMA3_70B)
    p = run_json(capsys, "--model", d, "--gpu", "H100", "--tensor-parallel-size", 4)
    assert p["kv_cache"]["kv_heads_per_gpu"] == 2
    assert p["kv_cache"]["bytes_per_token_per_gpu"] == p["kv_cache"]["bytes_per_token"] // 4
    assert p["weights"]["bytes_per_gpu"] == pytest.approx(p["weights"]["bytes_total"] / 4, rel=0.001)
    # tp=16 > 8 kv heads: kv heads replicated, one per rank
    p16 = run_json(capsys, "--model", d, "--gpu", "H100", "--tensor-parallel-size", 16)
    assert p16["kv_cache"]["kv_heads_per_gpu"] == 1


def test_out_of_memory_70b_on_l4(tmp_path, capsys):
    d = write_config(tmp_path, LLAMA3_70B)
    rc = planmod.run(parse("--model", d, "--gpu", "L4"))
    out = capsys.readouterr().out
    assert rc == 0
    assert "OUT OF MEMORY" in out
    assert "--tensor-parallel-size 8" in out  # a concrete fix
    p = run_json(capsys, "--model", d, "--gpu", "L4")
    assert p["verdict"]["fits"] is False and p["verdict"]["status"] == "oom_weights"
    assert p["fixes"] and all(f["flags"].startswith("--") for f in p["fixes"])
    assert p["recommended"]["max_num_seqs"] is None


def test_kv_oom_suggests_max_model_len_that_fits(tmp_path, capsys):
    d = write_config(tmp_path, LLAMA2_13B)
    p = run_json(capsys, "--model", d, "--gpu", "A100-40GB", "--max-model-len", 65536)
    assert p["verdict"]["status"] == "oom_kv"
    fix = next(f for f in p["fixes"] if f["change"] == "max_model_len")
    fit_len = int(fix["flags"].split()[-1])
    assert 0 < fit_len < 65536 and fit_len % 16 == 0
    ok = run_json(capsys, "--model", d, "--gpu", "A100-40GB", "--max-model-len", fit_len)
    assert ok["verdict"]["fits"] is True
    assert run_json(capsys, "--model", d, "--gpu", "A100-40GB", "--max-model-len", fit_len + 16 * 64)[
        "verdict"]["fits"] is False
    assert any(f["change"].startswith("kv_cache_dtype") for f in p["fixes"])
    assert any(f["change"].startswith("gpu") for f in p["fixes"])


def test_tp_that_does_not_divide_heads_is_refused(tmp_path, capsys):
    d = write_config(tmp_path, LLAMA2_13B)
    msg = run_fail(capsys, "--model", d, "--gpu", "H100", "--tensor-parallel-size", 3)
    assert "does not divide num_attention_heads 40" in msg and "valid sizes" in msg
    d8 = write_config(tmp_path, LLAMA3_8B, "l3")
    msg = run_fail(capsys, "--model", d8, "--gpu", "H100", "--tensor-parallel-size", 6)
    assert "num_attention_heads 32" in msg
    cfg = dict(LLAMA3_8B, num_attention_heads=48, num_key_value_heads=12, hidden_size=6144, intermediate_size=12288)
    msg = run_fail(capsys, "--model", write_config(tmp_path, cfg, "kv"), "--gpu", "H100", "-tp", 8)
    assert "num_key_value_heads 12" in msg


def test_user_errors_are_one_line(tmp_path, capsys):
    d = write_config(tmp_path, LLAMA2_13B)
    msg = run_fail(capsys, "--model", d, "--gpu", "V100")
    assert "known GPUs" in msg and "H100-80GB" in msg and "RTX-4090" in msg
    msg = run_fail(capsys, "--model", tmp_path / "nope", "--gpu", "H100")
    assert "config.json" in msg
    bad = write_config(tmp_path, {"model_type": "llama", "hidden_size": 64}, "bad")
    assert "lacks" in run_fail(capsys, "--model", bad, "--gpu", "H100")
    moe = write_config(tmp_path, dict(LLAMA3_8B, num_local_experts=8), "moe")
    assert "mixture-of-experts" in run_fail(capsys, "--model", moe, "--gpu", "H100")


def test_json_keys_are_stable(tmp_path, capsys):
    p = run_json(capsys, "--model", write_config(tmp_path, LLAMA3_8B), "--gpu", "l4", "--max-model-len", 4096)
    assert tuple(p) == planmod.JSON_KEYS
    assert set(p["recommended"]) >= {"max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization"}
    assert set(p["decode"]) >= {"single_sequence_tokens_per_s", "aggregate_tokens_per_s_at_target"}
    assert set(p["verdict"]) == {"fits", "status", "message"}


def test_gpu_table_is_complete():
    gpus = planmod.load_gpus()
    want = {"A10G", "L4", "L40S", "A100-40GB", "A100-80GB", "H100-80GB", "H100-PCIe", "H200", "B200", "RTX-4090"}
    assert set(gpus) == want
    for name, g in gpus.items():
        assert g["memory_bytes"] > 20 * 2**30 and g["bandwidth_gb_s"] > 0 and g["bf16_tflops"] > 0, name
        assert g["note"], name
    assert gpus["A100-80GB"]["fp8_tflops"] is None and gpus["H100-80GB"]["fp8_tflops"] > 0


def test_cli_help_and_no_torch(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pagedserve", "plan", "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--tensor-parallel-size" in r.stdout and "--json" in r.stdout
    d = write_config(tmp_path, LLAMA2_13B)
    code = ("import sys; from pagedserve.cli import main; rc = main(['plan', '--model', sys.argv[1], '--gpu', 'H100',"
            " '--json']); assert 'torch' not in sys.modules, 'plan imported torch'; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, str(d)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["verdict"]["fits"] is True
    r = subprocess.run([sys.executable, "-m", "pagedserve", "plan", "--model", str(d), "--gpu", "H100", "-tp", "3"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("name", ["meta-llama/Meta-Llama-3-8B", "Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B-Instruct"])
def test_popular_model_names_plan_offline_from_the_built_in_table(capsys, name):
    p = run_json(capsys, "--model", name, "--gpu", "H100-80GB", "--max-model-len", 8192)
    assert "built-in table" in p["model"]["config"]
    assert p["params"]["total"] == hand_params(4096, 32, 32, 8, 14336, 128256, tied=False)
    assert p["kv_cache"]["bytes_per_token"] == 2 * 32 * 8 * 128 * 2


def test_every_built_in_config_plans(capsys):
    from pagedserve.plan.model_source import popular_models

    for name in popular_models():
        p = run_json(capsys, "--model", name, "--gpu", "H200", "--max-model-len", 4096)
        assert p["params"]["total"] > 1e8, name


def test_mixtral_is_planned_as_its_dense_equivalent_with_a_note(capsys):
    p = run_json(capsys, "--model", "Mixtral-8x7B-v0.1", "--gpu", "H100-80GB", "--tensor-parallel-size", 2,
                 "--max-model-len", 4096)
    assert "2 active per token" in p["model"]["config"]
    assert 46e9 < p["params"]["total"] < 47.5e9  # Mixtral-8x7B's published 46.7 B parameters


def test_unknown_name_is_one_line_listing_the_known_ones(capsys):
    line = run_fail(capsys, "--model", "acme/NoSuchModel-7B", "--gpu", "H100")
    assert "acme/NoSuchModel-7B" in line and "Meta-Llama-3-8B" in line


def test_short_gpu_name_says_which_variant_it_took(tmp_path, capsys):
    d = write_config(tmp_path, LLAMA3_8B)
    p = run_json(capsys, "--model", d, "--gpu", "H100", "--max-model-len", 4096)
    assert any(w.startswith("--gpu H100 taken as H100-80GB") and "H100-PCIe" in w for w in p["warnings"])
    p = run_json(capsys, "--model", d, "--gpu", "H100-80GB", "--max-model-len", 4096)
    assert not any("taken as" in w for w in p["warnings"])


@pytest.mark.parametrize("qtype", [None, "Q8_0"])
def test_a_gguf_file_is_planned_from_its_metadata(tmp_path, capsys, qtype):
    pytest.importorskip("gguf")
    from gguf_fixtures import write_gguf_from_hf
    from tiny_models import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", hidden_size=64, intermediate_size=128, num_layers=2)
    import gguf

    path = write_gguf_from_hf(hf, tmp_path / "tiny.gguf", gguf.GGMLQuantizationType[qtype] if qtype else None)
    from_gguf = run_json(capsys, "--model", path, "--gpu", "L4", "--max-model-len", 256)
    from_hf = run_json(capsys, "--model", hf, "--gpu", "L4", "--max-model-len", 256)
    assert "GGUF metadata" in from_gguf["model"]["config"]
    for key in ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
        assert from_gguf["model"][key] == from_hf["model"][key], key
    assert from_gguf["settings"]["quantization"] == ("int8" if qtype else None)


def test_quantization_method_names_count_their_bits(tmp_path, capsys):
    d = write_config(tmp_path, LLAMA3_8B)
    i4 = run_json(capsys, "--model", d, "--gpu", "H100", "--quantization", "int4")
    awq = run_json(capsys, "--model", d, "--gpu", "H100", "--quantization", "awq")
    assert awq["weights"]["bytes_total"] == i4["weights"]["bytes_total"]
    assert any("--quantization awq: 4-bit" in w for w in awq["warnings"])
    i8 = run_json(capsys, "--model", d, "--gpu", "H100", "--quantization", "int8")
    assert run_json(capsys, "--model", d, "--gpu", "H100", "--quantization", "w8a8")["weights"] == i8["weights"]
    gptq8 = write_config(tmp_path, {**LLAMA3_8B, "quantization_config": {"quant_method": "gptq", "bits": 8,
                                                                                 "group_size": 128}}, name="g8")
    assert run_json(capsys, "--model", gptq8, "--gpu", "H100", "--quantization", "gptq")["weights"] == i8["weights"]
