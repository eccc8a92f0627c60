"""Loss registry and the loss families; importing this package registers every loss.

Use: `spec = get_loss(name)`; `loss, metrics = spec.fn(logp_bt, batch, cfg)` with
`cfg = spec.config_cls(...)`; `spec.needs(cfg)` names the optional batch fields it reads.
Separable losses also give `spec.token_terms` / `spec.token_loss` (see losses/base.py).
Every module of this package is imported here, so a new loss is one new file (plus its test).
"""
from posttrain_jax.losses.base import (LOSSES, HeadInputs, LossSpec, get_loss, register_loss,
                                       weighted)
from posttrain_jax.registry import import_submodules

import_submodules(__name__)   # registers every loss, correction, aggregation
from posttrain_jax.losses.aggregation import AGGREGATIONS
from posttrain_jax.losses.distill import DistillConfig
from posttrain_jax.losses.full_distill import FullDistillConfig
from posttrain_jax.losses.grpo import CISPOConfig, GRPOConfig, GSPOConfig, M2POConfig, PGTerms
from posttrain_jax.losses.kl import KL_ESTIMATORS, KLConfig, kl_estimate
from posttrain_jax.losses.off_policy import (
    CORRECTIONS, CorrectionTerms, DecoupledConfig, GeoMaskConfig, IcePopConfig, M2POMaskConfig,
    MISConfig, NoCorrection, SeqTISConfig, TISConfig)
from posttrain_jax.losses.sft import SFTConfig

__all__ = [
    "AGGREGATIONS", "CORRECTIONS", "CISPOConfig", "CorrectionTerms", "DecoupledConfig",
    "DistillConfig", "FullDistillConfig", "HeadInputs",
    "GRPOConfig", "GSPOConfig", "GeoMaskConfig", "IcePopConfig", "KLConfig", "KL_ESTIMATORS",
    "LOSSES", "LossSpec", "M2POConfig", "M2POMaskConfig", "MISConfig", "NoCorrection", "PGTerms",
    "SFTConfig", "SeqTISConfig", "TISConfig", "get_loss", "kl_estimate", "register_loss",
    "weighted",
]
