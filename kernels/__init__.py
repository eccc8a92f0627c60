"""LM-head kernels: fused log-probs (+ entropy) with a custom VJP, a fused separable-loss path,
and teacher terms for distillation. Math and prior art in lm_head.py and teacher.py."""
from .lm_head import DEFAULT_IMPL, IMPLS, default_block_sizes, fused_logprob_loss, token_logprobs
from .reference import TopK
from .teacher import teacher_divergence, teacher_token_logprobs, topk_logprobs

__all__ = [
    "DEFAULT_IMPL", "IMPLS", "TopK", "default_block_sizes", "fused_logprob_loss",
    "teacher_divergence", "teacher_token_logprobs", "token_logprobs", "topk_logprobs",
]
