"""Load a Llama-family model: config, weights and tokenizer from a local HF folder or a GGUF.

A name that is not a local path is resolved through huggingface_hub (downloaded once into its
cache); tests and the default model never need the network.
"""
from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pagedserve.errors import ConfigError
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.model.spec import ModelSpec

log = logging.getLogger("pagedserve")

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    spec: ModelSpec
    tokenizer: object  # transformers PreTrainedTokenizerFast
    path: Path
    generation_eos_ids: list[int]
    quantization: object = None  # quant.methods.QuantMethod, or None for a dense model


def resolve_dtype(name: str, spec: ModelSpec, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    d = _DTYPES.get(spec.torch_dtype or "float32", torch.float32)
    if device.type == "cpu" and d == torch.float16:
        return torch.bfloat16  # fp16 GEMMs are slow or missing on CPUs; bf16 keeps the range
    return d


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    p = Path(model).expanduser()
    if p.exists():
        return p
    if model.count("/") == 1 and not model.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(model, revision=revision,
                                          allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]))
        except Exception as e:  # offline, unknown repo, gated...
            raise ConfigError(f"model {model!r} is not a local path and could not be fetched from the hub: {e}") from e
    raise ConfigError(f"model path {model!r} does not exist; pass a Hugging Face folder, a .gguf file, or a hub name")


def _safetensors_getter(path: Path):
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f.name for f in path.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"no *.safetensors weights found in {path} (pytorch .bin checkpoints are not supported)")
        weight_map = None
    handles = {f: safe_open(str(path / f), framework="pt") for f in files}
    if weight_map is None:
        weight_map = {k: f for f, h in handles.items() for k in h.keys()}

    def get(name: str) -> torch.Tensor:
        if name not in weight_map:
            raise ConfigError(f"checkpoint {path} has no tensor {name!r}")
        return handles[weight_map[name]].get_tensor(name)

    return get


@contextmanager
def _without_random_init():
    """Linear and Embedding layers built here keep their freshly allocated (uninitialised) weights:
    the checkpoint overwrites every one, so random init would only cost time. (Building on the meta
    device instead would make torch import its compiler stack, seconds of start-up.) The patch is
    process-wide for the duration of the build: model loading is not meant to race other threads
    that construct torch layers."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def _build(spec: ModelSpec, max_positions: int, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    with _without_random_init(), torch.device(device):
        model = LlamaForCausalLM(spec, max_positions, dtype)
    return model.to(device)  # the rotary tables are computed on the CPU, in float32


def load_model(model: str | os.PathLike, *, dtype: str, device: torch.device, max_positions: int | None = None,
               tokenizer: str | None = None, revision: str | None = None,
               quantization: str | None = None) -> LoadedModel:
    """quantization: the --quantization flag (None: whatever the checkpoint is; see pagedserve.quant)."""
    from pagedserve import quant

    path = resolve_model_path(str(model), revision)
    gguf_file = None
    try:
        from pagedserve.model.gguf_loader import resolve_gguf_path
    except ModuleNotFoundError:  # GGUF support not in this build
        resolve_gguf_path = None
    if resolve_gguf_path is not None:
        gguf_file = resolve_gguf_path(path)
    if gguf_file is not None:
        from pagedserve.model.gguf_loader import load_gguf

        method = quant.resolve(quantization, None, is_gguf=True)
        keep = method is not None and not method.dense
        ck = load_gguf(gguf_file, tokenizer_dir=tokenizer, keep_quantized=keep)
        spec = ModelSpec.from_hf_config(ck.config)
        tok = ck.tokenizer
        getter = ck.state_dict.__getitem__
        gen_eos: list[int] = []
        linears = method.builder(getter, ck.quantized) if keep else None
    else:
        if not (path / "config.json").exists():
            raise ConfigError(f"{path} has no config.json (expected a Hugging Face model folder or a .gguf file)")
        qcfg = json.loads((path / "config.json").read_text()).get("quantization_config")
        method = quant.resolve(quantization, qcfg, is_gguf=False)
        spec, tok = _spec_and_tokenizer(path, tokenizer)
        getter = _safetensors_getter(path)
        gen_eos = _generation_eos(path)
        linears = method.builder(getter) if method is not None else None
    # The engine checks prompt lengths against max_model_len itself; the tokenizer's own limit would
    # only add transformers' "Token indices sequence length is longer..." line to the server log.
    tok.model_max_length = 1 << 62
    torch_dtype = resolve_dtype(dtype, spec, device)
    n_pos = max(max_positions or 0, spec.max_position_embeddings)
    net = _build(spec, n_pos, torch_dtype, device)
    net.load_hf_state_dict(getter, linears)
    net.eval()
    eos = list(dict.fromkeys(gen_eos + spec.eos_token_ids + ([tok.eos_token_id] if tok.eos_token_id is not None else [])))
    return LoadedModel(net, spec, tok, path, eos, method)


def _spec_and_tokenizer(path: Path, tokenizer: str | None):
    """ModelSpec and tokenizer of a Hugging Face folder. transformers' AutoConfig imports its whole
    modelling stack (~2 s of start-up); when config.json is complete and the tokenizer names its
    class, neither needs it: AutoTokenizer picks the class from tokenizer_config.json and only reads
    model_type from the config it is given."""
    from transformers import AutoConfig, AutoTokenizer, PreTrainedConfig

    cfg_dict = json.loads((path / "config.json").read_text())
    spec = ModelSpec.from_complete_config_dict(cfg_dict)
    if spec is None:
        spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(path)))
    tok_cfg = path / "tokenizer_config.json"
    if tokenizer is None and tok_cfg.exists() and json.loads(tok_cfg.read_text()).get("tokenizer_class"):
        return spec, AutoTokenizer.from_pretrained(str(path), config=PreTrainedConfig(**cfg_dict))
    return spec, AutoTokenizer.from_pretrained(tokenizer or str(path))


def _generation_eos(path: Path) -> list[int]:
    f = path / "generation_config.json"
    if not f.exists():
        return []
    eos = json.loads(f.read_text()).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])
