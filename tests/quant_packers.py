"""Small independent packers: turn a tiny float checkpoint into AWQ / GPTQ / compressed-tensors / FP8
checkpoints, written from the formats' documentation (AutoAWQ's GEMM packing, AutoGPTQ's layout,
llm-compressor's pack-quantized format), plus the dense checkpoint holding exactly the weights the
quantized one decodes to (the reference a quantized run must match token for token).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack_along(vals: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Pack unsigned `vals` 32/bits per int32 along `dim`; value i of each word from position order[i]."""
    per = 32 // bits
    v = vals.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    if order is not None:
        v = v[..., list(order)]
    word = sum(v[..., i] << (bits * i) for i in range(per))
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    return word.movedim(-1, dim).contiguous()


def quantize_groups(w: torch.Tensor, bits: int, group: int, g_idx: torch.Tensor, sym: bool):
    """Min/max (asymmetric) or absmax (symmetric) quantization of w [N, K] in the groups g_idx names.
    Returns ints [N, K], zero points [N, G], float16 scales [N, G] and the decoded weight."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    top = 2 ** bits - 1
    ints = torch.empty(n, k, dtype=torch.int64)
    zeros = torch.empty(n, groups)
    scales = torch.empty(n, groups, dtype=torch.float16)
    for gi in range(groups):
        cols = (g_idx == gi).nonzero().flatten()
        wg = w[:, cols]
        if sym:
            s = (wg.abs().amax(1) * 2 / top).clamp(min=1e-6).half()
            z = torch.full((n,), float(2 ** (bits - 1)))
        else:
            lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
            s = ((hi - lo) / top).clamp(min=1e-6).half()
            z = torch.round(-lo / s.float()).clamp(0, top)
        ints[:, cols] = torch.round(wg / s.float()[:, None] + z[:, None]).clamp(0, top).to(torch.int64)
        zeros[:, gi], scales[:, gi] = z, s
    decoded = (ints.float() - zeros[:, g_idx]) * scales.float()[:, g_idx]
    return ints, zeros, scales, decoded


def _copy_base(src: Path, dst: Path, qcfg: dict | None):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if qcfg is not None:
        cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg))


def _linears(sd):
    for name in list(sd):
        parts = name.split(".")
        if name.startswith("model.layers.") and parts[-1] == "weight" and parts[-2] in LINEARS:
            yield name[: -len(".weight")]


def pack_checkpoint(src, out_dir, fmt: str, *, bits: int = 4, group: int = 32, sym: bool = False,
                    act_order: bool = False, seed: int = 0) -> tuple[Path, Path]:
    """Write (quantized dir, dense reference dir) for fmt in awq | gptq | compressed-tensors."""
    from safetensors.torch import load_file, save_file

    src, out_dir = Path(src), Path(out_dir)
    sd = load_file(str(src / "model.safetensors"))
    q_sd, ref_sd = dict(sd), dict(sd)
    for prefix in _linears(sd):
        # act-order permutes by the input's statistics: projections reading the same input share it
        shared_input = prefix.rsplit(".", 1)[0] + (".qkv" if prefix.endswith(("q_proj", "k_proj", "v_proj")) else
                                                   ".gate_up" if prefix.endswith(("gate_proj", "up_proj")) else "")
        gen = torch.Generator().manual_seed(seed + sum(map(ord, shared_input)))
        w = sd[prefix + ".weight"].float()
        n, k = w.shape
        natural = torch.arange(k) // group
        # act-order: each group still holds `group` columns, scattered over the input
        g_idx = natural[torch.randperm(k, generator=gen)] if act_order else natural
        ints, zeros, scales, decoded = quantize_groups(w, bits, group, g_idx, sym)
        del q_sd[prefix + ".weight"]
        ref_sd[prefix + ".weight"] = decoded
        if fmt == "awq":
            q_sd[prefix + ".qweight"] = _pack_along(ints.t(), 4, 1, AWQ_ORDER)
            q_sd[prefix + ".qzeros"] = _pack_along(zeros.t().to(torch.int64), 4, 1, AWQ_ORDER)
            q_sd[prefix + ".scales"] = scales.t().contiguous()
        elif fmt == "gptq":  # AutoGPTQ's original format stores zero − 1
            q_sd[prefix + ".qweight"] = _pack_along(ints.t(), bits, 0)
            q_sd[prefix + ".qzeros"] = _pack_along((zeros - 1).t().to(torch.int64), bits, 1)
            q_sd[prefix + ".scales"] = scales.t().contiguous()
            q_sd[prefix + ".g_idx"] = g_idx.to(torch.int32)
        elif fmt == "compressed-tensors":  # pack-quantized: signed values offset by 2^(bits-1), packed along K
            assert sym, "the packer writes compressed-tensors' symmetric schemes"
            q_sd[prefix + ".weight_packed"] = _pack_along(ints, bits, 1)
            q_sd[prefix + ".weight_scale"] = scales
            q_sd[prefix + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
        else:
            raise ValueError(fmt)
    if fmt == "awq":
        qcfg = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    elif fmt == "gptq":
        qcfg = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": act_order,
                "checkpoint_format": "gptq"}
    else:
        qcfg = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                    "num_bits": bits, "type": "int", "symmetric": True, "strategy": "group", "group_size": group,
                    "dynamic": False}}}}
    qdir, rdir = out_dir / f"{fmt}-q", out_dir / f"{fmt}-ref"
    _copy_base(src, qdir, qcfg)
    _copy_base(src, rdir, None)
    save_file(q_sd, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    save_file(ref_sd, str(rdir / "model.safetensors"), metadata={"format": "pt"})
    return qdir, rdir


def pack_per_channel(src, out_dir, fmt: str) -> tuple[Path, Path]:
    """Per-output-channel schemes: compressed-tensors W8A8-int8 (`int-quantized`: int8 weight, scale
    max|row| / 127, dynamic per-token int8 activations) and FP8 (`float-quantized`: e4m3 weight, scale
    max|row| / 448), and vLLM's `fp8` checkpoint (one scale per tensor). The reference holds the
    decoded weights (for w8a8, the weights only: its activations are quantized at run time)."""
    from safetensors.torch import load_file, save_file

    src, out_dir = Path(src), Path(out_dir)
    sd = load_file(str(src / "model.safetensors"))
    q_sd, ref_sd = dict(sd), dict(sd)
    for prefix in _linears(sd):
        w = sd[prefix + ".weight"].float()
        if fmt == "w8a8-int8":
            scale = w.abs().amax(1, keepdim=True) / 127
            q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
            decoded = q.float() * scale
        elif fmt == "ct-fp8":
            scale = w.abs().amax(1, keepdim=True) / 448
            q = (w / scale).to(torch.float8_e4m3fn)
            decoded = q.float() * scale
        elif fmt == "fp8":
            scale = (w.abs().max() / 448).reshape(1)
            q = (w / scale).to(torch.float8_e4m3fn)
            decoded = q.float() * scale
        else:
            raise ValueError(fmt)
        q_sd[prefix + ".weight"] = q
        q_sd[prefix + ".weight_scale"] = scale
        ref_sd[prefix + ".weight"] = decoded
    if fmt == "fp8":
        qcfg = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    else:
        int8 = fmt == "w8a8-int8"
        qcfg = {"quant_method": "compressed-tensors", "format": "int-quantized" if int8 else "float-quantized",
                "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 8, "type": "int" if int8 else "float", "symmetric": True, "strategy": "channel",
                    "dynamic": False}, "input_activations": {"num_bits": 8, "type": "int" if int8 else "float",
                                                             "symmetric": True, "strategy": "token", "dynamic": True}}}}
    qdir, rdir = out_dir / f"{fmt}-q", out_dir / f"{fmt}-ref"
    _copy_base(src, qdir, qcfg)
    _copy_base(src, rdir, None)
    save_file(q_sd, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    save_file(ref_sd, str(rdir / "model.safetensors"), metadata={"format": "pt"})
    return qdir, rdir
