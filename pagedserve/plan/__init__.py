"""`pagedserve plan`: will this model fit on this GPU, how many sequences at once, and how fast can decode go?

Pure arithmetic on the Hugging Face config.json of a Llama-family model (llama, mistral, qwen2, ...);
no torch, no weights read. Every number is an estimate with a documented formula:

* Parameters: embeddings V*H; per layer q (H x heads*hd), k and v (H x kv_heads*hd each), o (heads*hd x H),
  gate/up (H x I each), down (I x H), two RMSNorm weights (H each); q/k/v biases when model_type is qwen2;
  final norm H; lm_head V*H unless tie_word_embeddings. hd = config head_dim, else H / heads.
* Weight bytes: model dtype for everything, except with --quantization the decoder linear layers
  (q/k/v/o/gate/up/down) take 1 byte per weight + one fp32 scale per output channel (int8, fp8), or
  0.5 byte per weight + one fp16 scale per group of 128 input weights per output channel (int4).
  Embeddings, lm_head, norms and biases stay in the model dtype (as GPTQ/AWQ/fp8 checkpoints keep them).
* Tensor parallelism (vLLM's rules): num_attention_heads % tp == 0 and intermediate_size % tp == 0;
  kv heads are split when num_kv_heads % tp == 0, replicated (one kv head per rank) when tp % num_kv_heads
  == 0, refused otherwise. Linear layers and the (vocab-parallel) embedding/lm_head are split across
  ranks; norms are replicated. Memory figures are per GPU.
* KV cache bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes of the KV dtype
  (per GPU: kv heads per rank instead of kv_heads).
* Memory budget per GPU: KV budget = GPU memory x utilization - weights - activations - overhead, where
  activations = max_num_batched_tokens x (2*H + qkv_width/tp + 3*I/tp) x activation bytes
               + max_num_seqs x vocab x 4 (fp32 logits of the sampled rows)
  and overhead = 1 GiB fixed (CUDA context, cuBLAS/NCCL workspaces, CUDA graphs, fragmentation).
* Decode ceiling (memory-bandwidth bound): every decode step reads all of a GPU's weights once plus the
  KV of every running sequence, so per-sequence tokens/s <= bandwidth / (weights + n x context x KV/token)
  and the aggregate is n times that. Real engines reach roughly 50-80 % of it.
"""
from pagedserve.plan.build import build_plan
from pagedserve.plan.cli import main, register, run
from pagedserve.plan.inputs import JSON_KEYS, PlanError, load_gpus
from pagedserve.plan.report import format_text

__all__ = ["JSON_KEYS", "PlanError", "build_plan", "format_text", "load_gpus", "main", "register", "run"]
