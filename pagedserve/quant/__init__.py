"""Quantized weights: which method a model runs with, and the linears that compute from them.

`resolve(flag, quantization_config, is_gguf)` decides the method the way vLLM does: the
checkpoint's config.json `quantization_config` (or the GGUF file itself) names it, `--quantization`
may repeat it (or name one of vLLM's aliases of it), and a flag that contradicts the checkpoint is
a ConfigError. Methods that quantize a full-precision checkpoint at load (`int8`, `w8a8`, `fp8`)
need one without a quantization_config. `none` runs a quantized checkpoint dequantized to the
model dtype (the dense reference a quantized run is compared with).

One file per format holds its layout and loader (awq.py, gptq.py, compressed_tensors.py, gguf.py,
int8.py, fp8.py); integer formats load into grouped.py's layout and its linear, which calls the
native kernel (csrc/quant_linear_cpu.cpp). The model never asks which format it holds: its loader
hands every decoder linear to the method's `LinearBuilder` (builder.py).
"""
from __future__ import annotations

from pagedserve.errors import ConfigError

# --quantization values (vLLM's names) → the method that serves them
METHODS = ("awq", "gptq", "compressed-tensors", "int8", "w8a8", "fp8", "gguf")
ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}
FROM_FULL_PRECISION = ("int8", "w8a8", "fp8")  # quantized at load, no prepared file
CHECKPOINT_FORMATS = ("awq", "gptq", "compressed-tensors", "fp8", "gguf")  # read from a quantized checkpoint
CHOICES = METHODS + tuple(ALIASES) + ("none",)


def supported_line() -> str:
    return ", ".join(METHODS) + " (or none)"


def validate_flag(flag: str | None) -> None:
    if flag is not None and flag.lower() not in CHOICES:
        raise ConfigError(f"quantization={flag!r} is not supported; use one of {supported_line()} (--quantization)")


def resolve(flag: str | None, qcfg: dict | None, is_gguf: bool):
    """The QuantMethod to load with, or None for a dense model."""
    from pagedserve.quant.methods import method_for

    validate_flag(flag)
    flag = ALIASES.get(flag.lower(), flag.lower()) if flag else None
    if is_gguf:
        checkpoint = "gguf"
    elif qcfg:
        if not isinstance(qcfg, dict):
            raise ConfigError("config.json quantization_config is not an object")
        name = str(qcfg.get("quant_method", "")).lower()
        checkpoint = ALIASES.get(name, name)
        if checkpoint not in CHECKPOINT_FORMATS or checkpoint == "gguf":
            raise ConfigError(f"config.json quantization_config has quant_method={name or '?'}, which pagedserve "
                              f"does not load; supported checkpoint formats: {', '.join(CHECKPOINT_FORMATS)}")
    else:
        checkpoint = None
    if flag == "none":
        return method_for(checkpoint, qcfg, dense=True) if checkpoint else None
    if checkpoint is None:
        if flag is None:
            return None
        if flag not in FROM_FULL_PRECISION:
            raise ConfigError(f"--quantization {flag} needs a {flag} checkpoint, but this model has no "
                              f"quantization_config; a full-precision model takes --quantization {' or '.join(FROM_FULL_PRECISION)}")
        return method_for(flag, None)
    if flag is not None and flag != checkpoint:
        raise ConfigError(f"--quantization {flag} contradicts the checkpoint, which is quantized with {checkpoint}; "
                          f"pass --quantization {checkpoint} (or leave the flag out, or none to run it dequantized)")
    return method_for(checkpoint, qcfg)
