"""Engine command-line flags, named as vLLM names them, mapped onto EngineConfig.

`add_engine_args(parser)` is shared by `pagedserve serve`, `pagedserve generate` and the
`python -m pagedserve.entrypoints.openai.api_server` entry point; `config_from_args(args)` turns the
parsed namespace into an EngineConfig (statically validated: a bad flag fails before any model
is loaded).

vLLM flags that pagedserve recognises but does not implement yet are registered too, so passing
one exits at once with one clear line ("pagedserve does not support --X yet") instead of being
silently ignored or reported as an unknown argument.
"""
from __future__ import annotations

import argparse

from pagedserve.config import EngineConfig


def _quant_methods() -> tuple[str, ...]:
    from pagedserve.quant import METHODS

    return METHODS


def _none_or_int(v: str) -> int | None:
    if v.lower() in ("none", "null", ""):
        return None
    return int(v)


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", type=str, default=None,
                   help="HF model directory, .gguf file or hub name (default: the built-in default model)")
    g.add_argument("--tokenizer", type=str, default=None, help="tokenizer directory or name (default: --model)")
    g.add_argument("--dtype", type=str, default=d.dtype, help="auto | float32 | bfloat16 | float16 (default: auto)")
    g.add_argument("--seed", type=int, default=d.seed, help="random seed (default: %(default)s)")
    g.add_argument("--device", type=str, default=d.device, choices=["auto", "cpu", "cuda"],
                   help="device to run on (default: auto)")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="most sequences in one batch (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens in one engine step (default: 2048 with chunked prefill, else max-model-len)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's limit)")
    g.add_argument("--max-input-tokens", type=int, default=None,
                   help="refuse prompts longer than this many tokens (TGI's flag; default: max-model-len - 1)")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV-cache block (default: %(default)s)")
    g.add_argument("--kv-cache-space", type=float, default=d.kv_cache_space,
                   help="GiB of KV cache on the CPU (vLLM's VLLM_CPU_KVCACHE_SPACE; default: %(default)s)")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="fraction of GPU memory to use (default: %(default)s)")
    g.add_argument("--num-gpu-blocks-override", type=_none_or_int, default=None,
                   help="use exactly this many KV-cache blocks (any device), skipping the memory profile")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
                   help="reuse the KV of shared prompt prefixes (default: on)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=d.enable_chunked_prefill, help="split long prompts across steps (default: on)")
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help="most logprobs a request may ask for (default: %(default)s)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                   help="only 1 is supported yet")
    g.add_argument("--enforce-eager", action="store_true", default=d.enforce_eager,
                   help="never capture CUDA graphs / compile")
    g.add_argument("--num-threads", type=int, default=None,
                   help="CPU threads for torch (default: the physical cores)")
    g.add_argument("--served-model-name", type=str, nargs="+", default=None,
                   help="name(s) the API answers to; the first is reported (default: --model)")
    g.add_argument("--trust-remote-code", action="store_true", default=False,
                   help="allow model code from the hub (pagedserve only runs its own model code)")
    g.add_argument("--revision", type=str, default=None, help="hub revision of the model")
    g.add_argument("--generation-config", type=str, default=d.generation_config,
                   help="default sampling parameters for fields a request leaves out: auto (the model's "
                        "generation_config.json), vllm (none), or a folder holding a generation_config.json")
    g.add_argument("--speculative-config", type=str, default=None,
                   help='speculative decoding as JSON with vLLM\'s keys, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}\'; '
                        'methods: ngram, suffix, draft_model (with "model": DIR)')
    g.add_argument("--speculative-model", type=str, default=None,
                   help="older form: a draft model folder, or [ngram] (with --num-speculative-tokens)")
    g.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="older form: tokens drafted per step (with --speculative-model)")
    g.add_argument("--quantization", "-q", type=str, default=None,
                   help="weight quantization (vLLM's names): default the checkpoint's own (config.json "
                        "quantization_config, or a GGUF's blocks); int8 / w8a8 quantize a full-precision model at "
                        "load; none runs a quantized checkpoint dequantized. Supported: " + ", ".join(_quant_methods()))
    _add_unsupported_args(parser)
    return parser


# ------------------------------------------------------------------------------------------------
# vLLM flags we recognise but do not support yet.
# (flag(s), takes a value?, values that are fine because they mean "the default")
_UNSUPPORTED: list[tuple[tuple[str, ...], bool, tuple[str, ...]]] = [
    (("--enable-lora",), False, ()),
    (("--lora-modules",), True, ()),
    (("--max-loras",), True, ()),
    (("--max-lora-rank",), True, ()),
    (("--pipeline-parallel-size", "-pp"), True, ("1",)),
    (("--data-parallel-size", "-dp"), True, ("1",)),
    (("--kv-cache-dtype",), True, ("auto",)),
    (("--distributed-executor-backend",), True, ()),
    (("--cpu-offload-gb",), True, ("0",)),
    (("--load-format",), True, ("auto", "safetensors")),
    (("--tokenizer-mode",), True, ("auto",)),
    (("--enable-auto-tool-choice",), False, ()),
    (("--tool-call-parser",), True, ()),
    (("--reasoning-parser",), True, ()),
    (("--guided-decoding-backend",), True, ()),
    (("--enable-expert-parallel",), False, ()),
    (("--rope-scaling",), True, ()),
    (("--hf-overrides",), True, ()),
    (("--limit-mm-per-prompt",), True, ()),
    (("--enable-sleep-mode",), False, ()),
    (("--kv-transfer-config",), True, ()),
    (("--compilation-config", "-O"), True, ()),
    (("--num-scheduler-steps",), True, ("1",)),
]


class _Unsupported(argparse.Action):
    def __init__(self, option_strings, dest, ok_values=(), **kw):
        self.ok_values = tuple(v.lower() for v in ok_values)
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        flag = next((o for o in self.option_strings if o.startswith("--")), option_string)
        if self.nargs == 0:
            parser.exit(2, f"pagedserve does not support {flag} yet\n")
        value = values if isinstance(values, str) else " ".join(map(str, values))
        if value.strip().lower() in self.ok_values:
            return  # the value vLLM treats as its default: nothing to do
        allowed = f" (only {' or '.join(self.ok_values)})" if self.ok_values else ""
        parser.exit(2, f"pagedserve does not support {flag} {value} yet{allowed}\n")


def _add_unsupported_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("vLLM flags not supported yet (passing one exits with an error)")
    for flags, takes_value, ok in _UNSUPPORTED:
        dest = "_unsupported_" + flags[0].lstrip("-").replace("-", "_")
        kw = dict(action=_Unsupported, dest=dest, ok_values=ok, default=None, help=argparse.SUPPRESS)
        if not takes_value:
            kw["nargs"] = 0
        g.add_argument(*flags, **kw)


# ------------------------------------------------------------------------------------------------
def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build an EngineConfig from parsed engine flags; static checks run here (ConfigError)."""
    names = getattr(args, "served_model_name", None)
    if isinstance(names, (list, tuple)):
        names = names[0] if names else None
    cfg = EngineConfig(
        model=getattr(args, "model", None),
        tokenizer=getattr(args, "tokenizer", None),
        dtype=args.dtype,
        seed=args.seed,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_input_tokens=getattr(args, "max_input_tokens", None),
        block_size=args.block_size,
        kv_cache_space=args.kv_cache_space,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        max_logprobs=args.max_logprobs,
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=args.enforce_eager,
        num_threads=getattr(args, "num_threads", None),
        served_model_name=names,
        trust_remote_code=args.trust_remote_code,
        revision=args.revision,
        generation_config=getattr(args, "generation_config", "auto"),
        speculative_config=_speculative_config(args),
        quantization=getattr(args, "quantization", None),
    )
    cfg.validate_static()
    return cfg


def _speculative_config(args: argparse.Namespace):
    from pagedserve.errors import ConfigError
    from pagedserve.spec.config import from_legacy_flags

    legacy = from_legacy_flags(getattr(args, "speculative_model", None), getattr(args, "num_speculative_tokens", None))
    given = getattr(args, "speculative_config", None)
    if legacy is not None and given is not None:
        raise ConfigError("use either --speculative-config or --speculative-model/--num-speculative-tokens, not both")
    return given if given is not None else legacy

