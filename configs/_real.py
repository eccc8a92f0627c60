"""Shared by configs/qwen3.py and configs/llama3.py: GRPO on a GSM8K-style JSONL file, for a
published architecture (posttrain_jax/models/published.py, with its sources) on a named slice.

The run reads two local paths and downloads nothing: `model.path` (a HF directory of the
architecture: config.json, *.safetensors, tokenizer) and `tasks.path` (JSON lines
`{"question": ..., "answer": "... #### 72"}`, GSM8K's own format; the numeric grader reads what
follows `####`). Without them the config is refused when it is validated, naming the field.
`launch/aot_check.py --config=configs/qwen3.py:8b,h200x8` compiles its train step without
either and reports per-device memory.

Step: 64 prompts × 8 samples = 512 sequences of ≤ 1024 tokens (prompt ≤ 256, ≤ 768 sampled),
one per row (no packing), split into micro-batches of `_MICRO_ROWS_PER_DEVICE` rows per
device; fp32 master weights and AdamW moments, bf16 matmuls, remat per block.

Slices (mesh axes data × fsdp × tensor; the batch rows are split over data × fsdp):
  h200x8   8 × H200 141 GB, fsdp 8. Rollouts: vLLM in the learner's process on GPU 0
           (tensor_parallel_size 1, bf16, max_model_len 1024), gpu_memory_utilization 0.3, so
           the learner has 70 % of that GPU (set XLA_PYTHON_CLIENT_MEM_FRACTION=0.65)
  h100x8   8 × H100 80 GB, the same with gpu_memory_utilization 0.35 (bf16 weights of an 8B
           model are 16.4 GB; the rest of its share is KV cache)
  v5e8     TPU v5e-8: 8 chips × 16 GiB, fsdp 8, the embedded JAX sampler (the vllm engine
           drives GPU and CPU vLLM only)
  v5p64    TPU v5p-64: 64 TensorCores = 32 chips (one device each, megacore) × 95 GiB,
           data 4 × fsdp 8, the embedded JAX sampler
"""
from posttrain_jax.run_config import base_config

# name: (devices, device kind, mesh, rollout engine, vLLM's share of GPU 0 or None)
SLICES = {
    "h200x8": (8, "h200", dict(data=1, fsdp=8, tensor=1), "vllm", 0.30),
    "h100x8": (8, "h100", dict(data=1, fsdp=8, tensor=1), "vllm", 0.35),
    "v5e8": (8, "v5e", dict(data=1, fsdp=8, tensor=1), "jax", None),
    "v5p64": (32, "v5p", dict(data=4, fsdp=8, tensor=1), "jax", None),
}
# rows of 1024 tokens per device in one micro-batch, by device kind and model size (B params)
_MICRO_ROWS_PER_DEVICE = {"h200": (4, 2), "h100": (2, 1), "v5e": (1, 1), "v5p": (2, 1)}

PROMPTS, GROUP, SEQ_LEN, MAX_TOKENS = 64, 8, 1024, 768


def slice_of(arg: str) -> str:
  """The slice named in a config argument like '8b,h200x8' (None when it names none)."""
  return next((p for p in arg.split(",") if p in SLICES), None)


def grpo_gsm8k(arch: str, billions: float, slice_name: str):
  """The RunConfig (as a ConfigDict) of GRPO on GSM8K for `arch` on `slice_name`."""
  if slice_name not in SLICES:
    raise ValueError(f"unknown slice {slice_name!r}; slices: {', '.join(SLICES)}")
  devices, kind, mesh, engine, vllm_share = SLICES[slice_name]
  c = base_config()
  c.workdir = f"runs/{arch}_gsm8k_{slice_name}"
  c.model.update(arch=arch, param_dtype="float32", compute_dtype="bfloat16", remat=True)
  c.tasks.update(source="jsonl", prompt_field="question", answer_field="answer", chat=True,
                 eval_fraction=0.02, eval_size=256, seed=0)
  c.grader = "numeric"
  c.sft.steps = 0
  rows = PROMPTS * GROUP
  split = mesh["data"] * mesh["fsdp"]
  per_device = _MICRO_ROWS_PER_DEVICE[kind][0 if billions < 3 else 1]
  c.rl.update(steps=200, prompts_per_step=PROMPTS, engine=engine)
  c.rl.rollout.update(group_size=GROUP, max_tokens=MAX_TOKENS, temperature=1.0)
  c.rl.learner.update(loss="grpo", micro_batches=rows // (per_device * split))
  c.rl.learner.optimizer.update(learning_rate=1e-6, warmup_steps=10, weight_decay=0.0)
  c.rl.loss = dict(eps_low=0.2, eps_high=0.28, aggregation="token_mean")
  c.rl.batch.update(rows=rows, seq_len=SEQ_LEN, max_seqs=rows, pack=False)
  if engine == "vllm":
    c.rl.engine_config = dict(dtype="bfloat16", max_model_len=SEQ_LEN, tensor_parallel_size=1,
                              gpu_memory_utilization=vllm_share, max_num_seqs=rows,
                              enable_prefix_caching=True)
  c.eval.update(every_steps=50, samples_per_prompt=1, temperature=1.0, greedy=True,
                max_tokens=MAX_TOKENS)
  c.checkpoint.update(every_steps=50, max_to_keep=2)
  c.mesh.update(**mesh)
  return c
