"""GRPO on GSM8K for Qwen3 dense models: `--config=configs/qwen3.py:<size>,<slice>`.

Sizes: 0.6b, 1.7b, 4b, 8b (architectures and their sources: posttrain_jax/models/published.py);
slices: h200x8, h100x8, v5e8, v5p64 (meshes and rollout settings: configs/_real.py). Give the
two local paths, nothing is downloaded:

    python launch/train.py --config=configs/qwen3.py:8b,h200x8 \\
        --config.model.path=/models/Qwen3-8B --config.tasks.path=/data/gsm8k/train.jsonl
    python launch/aot_check.py --config=configs/qwen3.py:8b,h200x8   # memory, no weights

Without them validation fails naming model.path (and tasks.path). Not every pair fits:
launch/aot_check.py refuses 4b and 8b on v5e8 (16 GiB chips) with the numbers.
"""
from posttrain_jax.configs._real import SLICES, grpo_gsm8k

SIZES = {"0.6b": 0.6, "1.7b": 1.7, "4b": 4.0, "8b": 8.2}


def get_config(arg: str = "8b,h200x8"):
  parts = arg.split(",")
  if len(parts) != 2 or parts[0] not in SIZES or parts[1] not in SLICES:
    raise ValueError(f"configs/qwen3.py takes ':<size>,<slice>' with size in {list(SIZES)} and "
                     f"slice in {list(SLICES)}, got {arg!r}")
  return grpo_gsm8k(f"qwen3-{parts[0]}", SIZES[parts[0]], parts[1])
