"""The quantization methods by name: what each reads from the checkpoint, and its Format."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.quant.builder import Format, LinearBuilder


@dataclass
class QuantMethod:
    name: str
    config: dict = field(default_factory=dict)  # the checkpoint's quantization_config (may be empty)
    dense: bool = False  # --quantization none: dequantize into the dense model

    def describe(self) -> str:
        return f"{self.name}{' dequantized (--quantization none)' if self.dense else ''}"

    def builder(self, get, gguf_quantized: dict | None = None) -> LinearBuilder:
        return LinearBuilder(self.format(get, gguf_quantized), get, dense=self.dense)

    def format(self, get, gguf_quantized: dict | None = None) -> Format:
        if self.name == "gguf":
            from pagedserve.quant.gguf import GGUFFormat

            return GGUFFormat(get, gguf_quantized or {})
        if self.name == "int8":
            from pagedserve.quant.int8 import Int8Format

            return Int8Format(get)
        if self.name == "w8a8":
            from pagedserve.quant.int8 import W8A8Format

            return W8A8Format(get)
        if self.name == "awq":
            from pagedserve.quant.awq import AWQFormat

            return AWQFormat(get, self.config)
        if self.name == "gptq":
            from pagedserve.quant.gptq import GPTQFormat

            return GPTQFormat(get, self.config)
        if self.name == "compressed-tensors":
            from pagedserve.quant.compressed_tensors import CompressedTensorsFormat

            return CompressedTensorsFormat(get, self.config)
        if self.name == "fp8":
            from pagedserve.quant.fp8 import DynamicFp8Format, Fp8Format

            return Fp8Format(get, self.config) if self.config else DynamicFp8Format(get)
        raise AssertionError(self.name)


def method_for(name: str, qcfg: dict | None, dense: bool = False) -> QuantMethod:
    """The method `name` with the checkpoint's quantization_config checked (ConfigError: one line)."""
    method = QuantMethod(name, dict(qcfg or {}), dense)
    if name == "awq":
        from pagedserve.quant.awq import check_config

        check_config(method.config)
    elif name == "gptq":
        from pagedserve.quant.gptq import check_config

        check_config(method.config)
    elif name == "compressed-tensors":
        from pagedserve.quant.compressed_tensors import parse

        parse(method.config)
    elif name == "fp8" and method.config:
        from pagedserve.quant.fp8 import check_config

        check_config(method.config)
    return method
