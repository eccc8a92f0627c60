"""GRPO on GSM8K for Llama 3.2: `--config=configs/llama3.py:<size>,<slice>`.

Sizes: 1b, 3b (Llama-3.2-1B / -3B; the -Instruct models share the architecture; sources in
posttrain_jax/models/published.py); slices: h200x8, h100x8, v5e8, v5p64 (configs/_real.py).
Give the two local paths, nothing is downloaded:

    python launch/train.py --config=configs/llama3.py:1b,h100x8 \\
        --config.model.path=/models/Llama-3.2-1B-Instruct --config.tasks.path=/data/gsm8k/train.jsonl
    python launch/aot_check.py --config=configs/llama3.py:1b,h100x8  # memory, no weights

Without them validation fails naming model.path (and tasks.path).
"""
from posttrain_jax.configs._real import SLICES, grpo_gsm8k

SIZES = {"1b": 1.2, "3b": 3.2}


def get_config(arg: str = "1b,h100x8"):
  parts = arg.split(",")
  if len(parts) != 2 or parts[0] not in SIZES or parts[1] not in SLICES:
    raise ValueError(f"configs/llama3.py takes ':<size>,<slice>' with size in {list(SIZES)} and "
                     f"slice in {list(SLICES)}, got {arg!r}")
  return grpo_gsm8k(f"llama3.2-{parts[0]}", SIZES[parts[0]], parts[1])
