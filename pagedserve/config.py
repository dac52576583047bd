"""EngineConfig: every engine knob in one place, named as vLLM names it, validated once.

The CLI, the Python API and the server all build this object; anything that cannot work fails
here, at start, with a message that names the flag to change.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from pagedserve.errors import ConfigError

SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64, 128)
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton", "flash-attn")
_ALIASES = {"flash_attn": "flash-attn", "flash-attention": "flash-attn", "flashattn": "flash-attn", "flash": "flash-attn",
            "native": "auto"}

# Environment variables that override a default of EngineConfig (documented in docs/architecture.md).
# They are read here and nowhere else: the rest of the engine reads the config.
ENV_OVERRIDES = {
    "cpu_kernels": "PAGEDSERVE_CPU_KERNELS",  # 0: no native CPU kernels (the torch path; CI runs it)
    "attention_backend": "PAGEDSERVE_ATTENTION_BACKEND",  # auto | cpu | torch | triton | flash-attn
    "cpu_gemm": "PAGEDSERVE_CPU_GEMM",  # auto | onednn | avx2
    "pack_weights": "PAGEDSERVE_PACK_WEIGHTS",  # 0: plain torch linears on the CPU
    "greedy_screen": "PAGEDSERVE_GREEDY_SCREEN",  # auto | int8 | bf16 | 0
    "silu_epilogue": "PAGEDSERVE_SILU_EPILOGUE",  # 0: the MLP's SiLU as its own pass
    "malloc_tuning": "PAGEDSERVE_MALLOC_TUNING",  # 0: leave glibc malloc's defaults
    "populate_kv": "PAGEDSERVE_POPULATE_KV",  # 0: do not fault the KV pool's pages in ahead
    "cuda_graphs": "PAGEDSERVE_CUDA_GRAPHS",  # 1: capture decode steps (experimental)
}
CACHE_ENV = "PAGEDSERVE_CACHE"  # built native kernels and benchmark models (default ~/.cache/pagedserve)


def _env_default(name: str, default):
    """The default of field `name`: its environment override if set, else `default`."""
    raw = os.environ.get(ENV_OVERRIDES[name])
    if raw is None or raw.strip() == "":
        return default
    raw = raw.strip()
    if isinstance(default, bool):
        return raw.lower() not in ("0", "false", "no", "off")
    return raw.lower()


def _env(name: str, default):
    return field(default_factory=lambda: _env_default(name, default))


def env_flag(name: str, default: bool) -> bool:
    """An override for code that runs without an EngineConfig (the kernel libraries themselves)."""
    return _env_default(name, default)


def cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "pagedserve")


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or hub name; None → the embedded default
    tokenizer: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: 2048 (chunked) or max_model_len
    max_model_len: int | None = None  # default: the model's limit
    max_input_tokens: int | None = None  # longest prompt accepted (TGI's flag); default: max_model_len - 1
    block_size: int = 16
    kv_cache_space: float = 4.0  # GiB of KV cache on the CPU (vLLM's VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    num_threads: int | None = None  # CPU threads for torch; default: physical cores
    served_model_name: str | None = None
    trust_remote_code: bool = False
    revision: str | None = None
    generation_config: str = "auto"  # auto | vllm | a folder: default sampling parameters (generation_defaults.py)
    # speculative decoding: None, or a dict / JSON string with vLLM's keys (pagedserve/spec/config.py);
    # validate_static turns it into a SpeculativeConfig
    speculative_config: object = None
    quantization: str | None = None  # see pagedserve.quant: None = as the checkpoint is; "none" = dequantized
    # device path (CPU kernels, attention backend, packing); defaults from ENV_OVERRIDES
    cpu_kernels: bool = _env("cpu_kernels", True)
    attention_backend: str = _env("attention_backend", "auto")
    cpu_gemm: str = _env("cpu_gemm", "auto")
    pack_weights: bool = _env("pack_weights", True)
    greedy_screen: str = _env("greedy_screen", "auto")
    silu_epilogue: bool = _env("silu_epilogue", True)
    malloc_tuning: bool = _env("malloc_tuning", True)
    populate_kv: bool = _env("populate_kv", True)
    cuda_graphs: bool = _env("cuda_graphs", False)
    # resolved at load time (not user knobs)
    extra: dict = field(default_factory=dict)

    def validate_static(self) -> None:
        """Checks that need no model: run before anything heavy is loaded."""
        from pagedserve.generation_defaults import check_setting

        check_setting(self.generation_config)
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ConfigError(
                f"block_size={self.block_size} is not supported; use one of {', '.join(map(str, SUPPORTED_BLOCK_SIZES))} (--block-size)"
            )
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs} (--max-num-seqs)")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16", "fp32"):
            raise ConfigError(f"dtype={self.dtype!r} is not supported; use auto, float32, bfloat16 or float16 (--dtype)")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization} (--gpu-memory-utilization)"
            )
        if self.kv_cache_space <= 0:
            raise ConfigError(f"kv_cache_space must be > 0 GiB, got {self.kv_cache_space} (--kv-cache-space)")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ConfigError("num_gpu_blocks_override must be >= 1 (--num-gpu-blocks-override)")
        if self.tensor_parallel_size != 1:
            raise ConfigError(
                f"tensor_parallel_size={self.tensor_parallel_size} is not supported yet; use --tensor-parallel-size 1"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("max_model_len must be >= 1 (--max-model-len)")
        if self.max_input_tokens is not None and self.max_input_tokens < 1:
            raise ConfigError("max_input_tokens must be >= 1 (--max-input-tokens)")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be >= 1 (--max-num-batched-tokens)")
        from pagedserve.spec.config import SpeculativeConfig

        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        from pagedserve.quant import validate_flag

        validate_flag(self.quantization)
        self.attention_backend = _ALIASES.get(self.attention_backend, self.attention_backend)
        self.cpu_gemm = _ALIASES.get(self.cpu_gemm, self.cpu_gemm)
        for name, choices in (("attention_backend", ATTENTION_BACKENDS), ("cpu_gemm", ("auto", "onednn", "avx2")),
                              ("greedy_screen", ("auto", "int8", "bf16", "0"))):
            value = getattr(self, name)
            if value not in choices:
                raise ConfigError(f"{name}={value!r} is not one of {', '.join(choices)} (env {ENV_OVERRIDES[name]})")

    def resolve(self, model_max_len: int, sliding_window: int | None = None) -> None:
        """Fill the defaults that depend on the model and check the combinations."""
        self.validate_static()
        if self.max_model_len is None:
            self.max_model_len = model_max_len
            if sliding_window is not None and sliding_window < self.max_model_len:
                # Within the window, sliding-window attention IS full attention: cap the length.
                self.max_model_len = sliding_window
        elif self.max_model_len > model_max_len:
            raise ConfigError(
                f"max_model_len={self.max_model_len} is above the model's limit of {model_max_len} tokens; "
                f"use --max-model-len {model_max_len} or less"
            )
        if sliding_window is not None and self.max_model_len > sliding_window:
            raise ConfigError(
                f"this model uses sliding-window attention (window {sliding_window}), which pagedserve does not "
                f"implement yet; use --max-model-len {sliding_window} or less (attention is then exact)"
            )
        if self.max_input_tokens is not None and self.max_input_tokens >= self.max_model_len:
            raise ConfigError(
                f"max_input_tokens={self.max_input_tokens} leaves no room to generate within max_model_len="
                f"{self.max_model_len}; use --max-input-tokens {self.max_model_len - 1} or less"
            )
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (
                max(2048, self.max_num_seqs) if self.enable_chunked_prefill else max(self.max_model_len, self.max_num_seqs)
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than max_model_len={self.max_model_len} "
                "with chunked prefill off, so long prompts could never be scheduled; raise --max-num-batched-tokens to "
                f"{self.max_model_len}, lower --max-model-len, or enable chunked prefill"
            )

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)


def set_openmp_wait_default() -> None:
    """How long idle OpenMP threads spin before they sleep, for a process that `pagedserve` starts.

    Spinning without end (OMP_WAIT_POLICY=active) collapses when another process takes a core: W1
    (64 requests, 2 cores, a busy loop on one) took 59.6 s vs 39.6 s passive. Sleeping at once
    (passive) pays a futex wake-up under the hypervisor for each of the ~200 parallel regions of a
    step: W1-64 alone took 21.8-23.5 s passive vs 16.5-17.0 s with a short spin. About 2000 spins
    (~20 us) covers the gaps between ops within a step and still yields the core quickly.

    libgomp reads this when torch loads it, so the command line calls this before importing
    torch; a user's own setting of either variable wins. Importing pagedserve as a library leaves
    the environment alone (a program embedding the engine sets GOMP_SPINCOUNT itself).
    """
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = "2000"


def default_num_threads() -> int:
    """Physical cores: hyper-threads share one core's FMA units and only add contention in GEMMs."""
    try:
        cores = set()
        with open("/proc/cpuinfo") as f:
            phys = core = None
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                    cores.add((phys, core))
        n = len(cores)
    except OSError:
        n = 0
    avail = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n or avail, avail))
