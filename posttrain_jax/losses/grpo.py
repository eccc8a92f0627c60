"""The GRPO family: PPO-clip per token (GRPO / DAPO / Dr.GRPO), CISPO, GSPO and M2PO.

With r_t = π_θ(y_t)/π_old(y_t) = exp(log π_θ − log π_old), A_t the advantage, c_t an off-policy
correction weight (losses/off_policy.py, stop-gradient, 1 by default) and w_t the aggregation
weight (losses/aggregation.py):

  grpo   ℓ_t = −min(r_t A_t, clip(r_t, 1−ε_low, 1+ε_high) A_t)      PPO (Schulman 2017), GRPO
                                                                    (DeepSeekMath 2024), ε_high =
                                                                    0.28 is DAPO's clip-higher
         dual-clip (Ye et al. 2020), for A_t < 0: ℓ_t ← min(ℓ_t, −c·A_t), c = 3 when enabled
  cispo  ℓ_t = −A_t · sg(clip(r_t, 1−ε_low, 1+ε_high)) · log π_θ(y_t)  (MiniMax-M1 2025;
                                                                    NeMo-RL defaults ε = 1, 5)
  m2po   ℓ_t = −M_t · r^μ_t · A_t, r^μ_t = π_θ(y_t)/μ(y_t), NO ε-clip  M2PO ("Prosperity before
                                                                    Collapse", Zheng et al. 2025)
         M_t ∈ {0, 1}: drop the sampled tokens with the largest (log π_old − log μ)², largest
         first, until the mean over the tokens left is < τ = 0.04 (a statistic of the call)
  all    loss = Σ_t w_t (c_t ℓ_t + β · k(log π_ref − log π_θ))       KL to a frozen reference,
                                                                    k ∈ {k2, k3} (losses/kl.py)
  gspo   s_i = exp(mean_{t∈i} log r_t),  ℓ_i = −min(s_i A_i, clip(s_i, 1−ε_low, 1+ε_high) A_i),
         loss = (1/n) Σ_i ℓ_i + β · KL (sequence-mean of token-means)  (GSPO, Qwen 2025;
                                                                    ε = 3e-4, 4e-4)

The KL term's gradient (losses/kl.py): k3, the default kept from the GRPO paper, gives the
gradient of the *forward* KL(π_ref‖π_θ) although its value estimates KL(π_θ‖π_ref); k2 gives
the reverse-KL gradient; k1 gives no signal toward π_ref and is refused when kl_coef > 0
(with kl_coef = 0 the estimator only sets the `kl` metric, and k1 is allowed there).

M2PO, two forms: the loss "m2po" is the paper's method (the mask *replaces* the PPO clip,
J = Σ M·r·A / Σ|o|, with r the ratio to the policy that sampled, μ, whose second moment the
mask bounds; `ratio_base="old"` takes r = π_θ/π_old instead). The correction "m2po_mask"
(losses/off_policy.py) is a hybrid: grpo's PPO-clip term, ε-clip kept, times the same mask.

grpo, cispo and m2po are separable: `token_terms(batch, cfg)` holds w_t, A_t, c_t, the
ratio's base log-prob and log π_ref as constants, `token_loss(logp, terms, cfg)` is
elementwise in logp, and the loss function is literally Σ token_loss. When `batch.old_logp`
is None (and nothing needs it) the update is on-policy: π_old = stop_gradient(π_θ), r_t = 1
with gradient ∇log π_θ (token_terms leaves the base None and token_loss uses
stop_gradient(logp)). Batch inputs (`LossSpec.needs`, losses/base.py): ref_logp iff
kl_coef > 0; old_logp and behaviour_logp iff the correction reads them (every one but "none");
behaviour_logp for cispo's ratio_base="behaviour"; both for m2po. A needed field that is None
raises on both paths; nothing is filled in for it.

Simplifications: the advantage is whatever the batch carries per token (GSPO averages it over
the sequence's sampled tokens, which equals A_i for the usual broadcast advantage); GSPO's
off-policy correction weights sequence i's term by c̄_i, the mean of its tokens' correction
weights c_t (exact for the sequence-level corrections seq_tis and geo_mask, whose c_t is one
value per sequence; the mean truncated weight for token-level ones) and its KL term is
aggregated per sequence like its policy term; a correction never weights the KL term. M2PO's second moment uses log π_old for log π_θ (the value before the
update; the paper recomputes it at every step), and the mask is per call, so micro-batching
changes it. Metrics (weighted pairs): loss, pg_loss, clip_frac_low / clip_frac_high (tokens, or
sequences for GSPO, where the clip removed the gradient), dual_clip_frac, ratio_mean, kl (token
mean of the chosen estimator, whenever batch.ref_logp is given), nll (mean −log π_θ), the
correction/* metrics of losses/off_policy.py, and for m2po: m2po/second_moment (mean
(log π_old − log μ)² over sampled tokens) and m2po/second_moment_kept (over the kept ones).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from posttrain_jax.losses import aggregation as agg
from posttrain_jax.losses import off_policy
from posttrain_jax.losses.base import Metrics, register_loss, weighted
from posttrain_jax.losses.kl import KL_ESTIMATORS, batch_field, check_loss_estimator, kl_estimate
from posttrain_jax.types import TrainBatch

sg = jax.lax.stop_gradient


def _validate_kl(cfg) -> None:
  """kl_coef ≥ 0; the estimator is registered, and usable as a loss term when kl_coef > 0."""
  name = type(cfg).__name__
  if cfg.kl_coef < 0:
    raise ValueError(f"{name}.kl_coef must be ≥ 0, got {cfg.kl_coef}")
  if cfg.kl_coef > 0:
    check_loss_estimator(cfg.kl_estimator, f"{name}.kl_estimator (kl_coef={cfg.kl_coef} > 0)")
  else:
    KL_ESTIMATORS.get(cfg.kl_estimator)   # the `kl` metric's estimator only


def _validate_pg(cfg) -> None:
  if not 0.0 <= cfg.eps_low <= 1.0 or cfg.eps_high < 0.0:
    raise ValueError(f"{type(cfg).__name__}: need 0 ≤ eps_low ≤ 1 and eps_high ≥ 0; got "
                     f"eps_low={cfg.eps_low}, eps_high={cfg.eps_high}")
  agg.validate_aggregation(cfg.aggregation, cfg.max_len)
  _validate_kl(cfg)
  off_policy.resolve(cfg.correction, cfg.correction_cfg)


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """PPO-clip per token with GRPO/DAPO/Dr.GRPO aggregation, optional KL and correction."""
  eps_low: float = 0.2                  # ratio clipped below at 1 − eps_low
  eps_high: float = 0.28                # ratio clipped above at 1 + eps_high (DAPO clip-higher)
  dual_clip_c: Optional[float] = None   # dual-clip c for A < 0 (3.0 in verl); None = off
  aggregation: str = "token_mean"       # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
  max_len: Optional[int] = None         # L_max of Dr.GRPO; needed by seq_mean_token_sum_norm
  kl_coef: float = 0.0                  # β of the KL-to-reference term; 0 = none, ref not needed
  kl_estimator: str = "k3"              # k3: forward-KL gradient; k2: reverse; k1 metric-only
  correction: str = "none"              # a name in losses.off_policy.CORRECTIONS
  correction_cfg: Any = None            # its config, e.g. TISConfig(cap=2.0); None = defaults

  def __post_init__(self):
    _validate_pg(self)
    if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
      raise ValueError(f"GRPOConfig.dual_clip_c must be > 1 (or None), got {self.dual_clip_c}")


@dataclasses.dataclass(frozen=True)
class CISPOConfig:
  """CISPO: clipped stop-gradient IS weight × log π_θ; aggregation/KL/correction as grpo."""
  eps_low: float = 1.0                  # weight clipped below at 1 − eps_low (1.0: no lower clip)
  eps_high: float = 5.0                 # weight clipped above at 1 + eps_high
  ratio_base: str = "old"               # r_t = π_θ / π_old ("old") or π_θ / μ ("behaviour")
  aggregation: str = "token_mean"       # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
  max_len: Optional[int] = None         # L_max of Dr.GRPO; needed by seq_mean_token_sum_norm
  kl_coef: float = 0.0                  # β of the KL-to-reference term; 0 = none
  kl_estimator: str = "k3"              # as GRPOConfig.kl_estimator (k1 only with kl_coef = 0)
  correction: str = "none"              # a name in losses.off_policy.CORRECTIONS
  correction_cfg: Any = None            # that correction's config; None = its defaults

  def __post_init__(self):
    _validate_pg(self)
    if self.ratio_base not in ("old", "behaviour"):
      raise ValueError(f"CISPOConfig.ratio_base is {self.ratio_base!r}; valid: 'old', 'behaviour'")


@dataclasses.dataclass(frozen=True)
class GSPOConfig:
  """GSPO: one length-normalised ratio per sequence, clipped tightly."""
  eps_low: float = 3e-4                 # s_i clipped below at 1 − eps_low
  eps_high: float = 4e-4                # s_i clipped above at 1 + eps_high
  kl_coef: float = 0.0                  # β of the KL-to-reference term; 0 = no term
  kl_estimator: str = "k3"              # as GRPOConfig.kl_estimator (k1 only with kl_coef = 0)
  correction: str = "none"              # a name in losses.off_policy.CORRECTIONS: sequence i's
                                        # term is weighted by the mean of its tokens' c_t
  correction_cfg: Any = None            # that correction's config; None = its defaults

  def __post_init__(self):
    if not 0.0 <= self.eps_low <= 1.0 or self.eps_high < 0.0:
      raise ValueError(f"GSPOConfig: need 0 ≤ eps_low ≤ 1 and eps_high ≥ 0; got "
                       f"eps_low={self.eps_low}, eps_high={self.eps_high}")
    _validate_kl(self)
    off_policy.resolve(self.correction, self.correction_cfg)


@dataclasses.dataclass(frozen=True)
class M2POConfig:
  """M2PO: the second-moment token mask in place of the PPO ε-clip (the paper's method)."""
  tau: float = 0.04                     # τ: drop largest (log π_old − log μ)² until mean < τ
  ratio_base: str = "behaviour"         # r_t = π_θ / μ ("behaviour", the paper) or / π_old ("old")
  aggregation: str = "token_mean"       # token_mean is the paper's 1 / Σ|o_i|
  max_len: Optional[int] = None         # L_max of Dr.GRPO; needed by seq_mean_token_sum_norm
  kl_coef: float = 0.0                  # β of the KL-to-reference term (none in the paper)
  kl_estimator: str = "k3"              # as GRPOConfig.kl_estimator (k1 only with kl_coef = 0)

  def __post_init__(self):
    if not self.tau > 0:
      raise ValueError(f"M2POConfig.tau must be > 0, got {self.tau}")
    if self.ratio_base not in ("old", "behaviour"):
      raise ValueError(f"M2POConfig.ratio_base is {self.ratio_base!r}; valid: 'old', 'behaviour'")
    agg.validate_aggregation(self.aggregation, self.max_len)
    _validate_kl(self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PGTerms:
  """Per-token constants of grpo / cispo / m2po, all [B, T] and stop-gradient."""
  weight_bt: jax.Array                  # aggregation weight w_t, mask included
  adv_bt: jax.Array                     # A_t
  corr_bt: jax.Array                    # off-policy weight c_t (m2po: the 0/1 mask M_t)
  base_logp_bt: Optional[jax.Array]     # log π_old (or log μ: ratio_base="behaviour"); None = sg
  ref_logp_bt: Optional[jax.Array]      # log π_ref; None when kl_coef == 0


def _pg_parts(batch: TrainBatch, cfg, base_field: str, name: str):
  """(PGTerms, CorrectionTerms): the token terms and the correction's clip/mask flags."""
  weight_bt, _ = agg.aggregation_weights(cfg.aggregation, batch, cfg.max_len)
  corr = off_policy.correction_terms(cfg.correction, cfg.correction_cfg, batch, f"loss {name!r}")
  base = getattr(batch, base_field)
  if base is None and base_field != "old_logp":
    base = batch_field(batch, base_field, f"loss {name!r} (ratio_base='behaviour')")
  ref = (batch_field(batch, "ref_logp", f"loss {name!r} with kl_coef > 0")
         if cfg.kl_coef > 0 else None)
  terms = PGTerms(weight_bt, sg(batch.advantages), corr.weight_bt,
                  None if base is None else sg(base), ref)
  return terms, corr


def _prepare(logp, terms: PGTerms):
  """Finite inputs on every position (padding may hold anything) and the ratio's base."""
  live = terms.weight_bt != 0
  logp = jnp.where(live, logp, 0.0)
  base = sg(logp) if terms.base_logp_bt is None else jnp.where(live, terms.base_logp_bt, 0.0)
  return live, logp, base


def _with_kl(ell, logp, live, terms: PGTerms, cfg):
  if terms.ref_logp_bt is not None:
    ell = ell + cfg.kl_coef * kl_estimate(logp, jnp.where(live, terms.ref_logp_bt, 0.0),
                                          cfg.kl_estimator)
  return jnp.where(live, terms.weight_bt * ell, 0.0)


def _ppo_clip(ratio, adv, cfg):
  ell = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high))
  if getattr(cfg, "dual_clip_c", None) is not None:
    ell = jnp.where(adv < 0, jnp.minimum(ell, -cfg.dual_clip_c * adv), ell)
  return ell


def _pg_inputs(cfg, base_field: str) -> set[str]:
  """ref_logp iff kl_coef > 0; the correction's fields; the ratio's base unless it is old_logp."""
  out = set(off_policy.correction_inputs(cfg.correction))
  if cfg.kl_coef > 0:
    out.add("ref_logp")
  if base_field != "old_logp":
    out.add(base_field)
  return out


# ------------------------------------------------------------------ grpo

def grpo_inputs(cfg: GRPOConfig) -> set[str]:
  return _pg_inputs(cfg, "old_logp")


def grpo_token_terms(batch: TrainBatch, cfg: GRPOConfig) -> PGTerms:
  return _pg_parts(batch, cfg, "old_logp", "grpo")[0]


def grpo_token_loss(logp: jax.Array, terms: PGTerms, cfg: GRPOConfig) -> jax.Array:
  live, logp, base = _prepare(logp, terms)
  ell = terms.corr_bt * _ppo_clip(jnp.exp(logp - base), terms.adv_bt, cfg)
  return _with_kl(ell, logp, live, terms, cfg)


def _common_metrics(logp_bt, batch, cfg, corr, loss, count, pg_loss) -> Metrics:
  sg_logp = sg(logp_bt)
  metrics = {"loss": weighted(loss * count, count), "pg_loss": weighted(pg_loss * count, count),
             "nll": agg.token_mean_metric(-sg_logp, batch)}
  if batch.ref_logp is not None:
    metrics["kl"] = agg.token_mean_metric(
        kl_estimate(sg_logp, jnp.where(batch.loss_mask > 0, batch.ref_logp, sg_logp),
                    cfg.kl_estimator), batch)
  metrics.update(off_policy.correction_metrics(
      sg_logp, batch, None if cfg.correction == "none" else corr))
  return metrics


def _ratio_metrics(ratio_bt, adv_bt, batch, cfg) -> Metrics:
  out = {"ratio_mean": agg.token_mean_metric(ratio_bt, batch),
         "clip_frac_low": agg.token_mean_metric(
             ((ratio_bt < 1.0 - cfg.eps_low) & (adv_bt < 0)).astype(jnp.float32), batch),
         "clip_frac_high": agg.token_mean_metric(
             ((ratio_bt > 1.0 + cfg.eps_high) & (adv_bt > 0)).astype(jnp.float32), batch)}
  if getattr(cfg, "dual_clip_c", None) is not None:
    out["dual_clip_frac"] = agg.token_mean_metric(
        ((ratio_bt > cfg.dual_clip_c) & (adv_bt < 0)).astype(jnp.float32), batch)
  return out


@register_loss("grpo", GRPOConfig, inputs=grpo_inputs, token_terms=grpo_token_terms,
               token_loss=grpo_token_loss)
def grpo_loss(logp_bt: jax.Array, batch: TrainBatch, cfg: GRPOConfig):
  """PPO-clip GRPO loss; see the module docstring."""
  terms, corr = _pg_parts(batch, cfg, "old_logp", "grpo")
  loss = jnp.sum(grpo_token_loss(logp_bt, terms, cfg))
  _, count = agg.aggregation_weights(cfg.aggregation, batch, cfg.max_len)
  live, logp, base = _prepare(sg(logp_bt), terms)
  ratio = jnp.exp(logp - base)
  pg_loss = jnp.sum(jnp.where(live, terms.weight_bt * terms.corr_bt
                              * _ppo_clip(ratio, terms.adv_bt, cfg), 0.0))
  metrics = _common_metrics(logp_bt, batch, cfg, corr, loss, count, pg_loss)
  metrics.update(_ratio_metrics(ratio, terms.adv_bt, batch, cfg))
  return loss, metrics


# ------------------------------------------------------------------ cispo

def _cispo_base(cfg: CISPOConfig) -> str:
  return "old_logp" if cfg.ratio_base == "old" else "behaviour_logp"


def cispo_inputs(cfg: CISPOConfig) -> set[str]:
  return _pg_inputs(cfg, _cispo_base(cfg))


def cispo_token_terms(batch: TrainBatch, cfg: CISPOConfig) -> PGTerms:
  return _pg_parts(batch, cfg, _cispo_base(cfg), "cispo")[0]


def _cispo_weight(ratio, cfg):
  return jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)


def cispo_token_loss(logp: jax.Array, terms: PGTerms, cfg: CISPOConfig) -> jax.Array:
  live, logp, base = _prepare(logp, terms)
  is_weight = sg(_cispo_weight(jnp.exp(logp - base), cfg))
  ell = terms.corr_bt * (-terms.adv_bt * is_weight * logp)
  return _with_kl(ell, logp, live, terms, cfg)


@register_loss("cispo", CISPOConfig, inputs=cispo_inputs, token_terms=cispo_token_terms,
               token_loss=cispo_token_loss)
def cispo_loss(logp_bt: jax.Array, batch: TrainBatch, cfg: CISPOConfig):
  """CISPO loss; see the module docstring."""
  terms, corr = _pg_parts(batch, cfg, _cispo_base(cfg), "cispo")
  loss = jnp.sum(cispo_token_loss(logp_bt, terms, cfg))
  _, count = agg.aggregation_weights(cfg.aggregation, batch, cfg.max_len)
  live, logp, base = _prepare(sg(logp_bt), terms)
  ratio = jnp.exp(logp - base)
  pg_loss = jnp.sum(jnp.where(live, terms.weight_bt * terms.corr_bt
                              * (-terms.adv_bt * _cispo_weight(ratio, cfg) * logp), 0.0))
  metrics = _common_metrics(logp_bt, batch, cfg, corr, loss, count, pg_loss)
  metrics["ratio_mean"] = agg.token_mean_metric(ratio, batch)
  metrics["clip_frac_low"] = agg.token_mean_metric(
      (ratio < 1.0 - cfg.eps_low).astype(jnp.float32), batch)
  metrics["clip_frac_high"] = agg.token_mean_metric(
      (ratio > 1.0 + cfg.eps_high).astype(jnp.float32), batch)
  return loss, metrics


# ------------------------------------------------------------------ gspo

def gspo_inputs(cfg: GSPOConfig) -> set[str]:
  out = set(off_policy.correction_inputs(cfg.correction))
  if cfg.kl_coef > 0:
    out.add("ref_logp")
  return out


@register_loss("gspo", GSPOConfig, inputs=gspo_inputs)
def gspo_loss(logp_bt: jax.Array, batch: TrainBatch, cfg: GSPOConfig):
  """GSPO loss (not separable: one ratio per sequence); see the module docstring."""
  live = batch.loss_mask > 0
  logp = jnp.where(live, logp_bt, 0.0)
  base = sg(logp) if batch.old_logp is None else jnp.where(live, sg(batch.old_logp), 0.0)
  len_s = agg.seq_lengths(batch)
  inv_len_s = jnp.where(len_s > 0, 1.0 / jnp.maximum(len_s, 1.0), 0.0)
  keep_s = agg.nonempty_seqs(batch)
  n = jnp.sum(keep_s)
  inv_n = jnp.where(n > 0, 1.0 / jnp.maximum(n, 1.0), 0.0)

  ratio_s = jnp.exp(agg.seq_sum(logp - base, batch) * inv_len_s)
  adv_s = agg.seq_sum(sg(batch.advantages), batch) * inv_len_s
  corr = off_policy.correction_terms(cfg.correction, cfg.correction_cfg, batch, "loss 'gspo'")
  corr_s = sg(agg.seq_sum(corr.weight_bt, batch) * inv_len_s)   # c̄_i: its tokens' mean c_t
  ell_s = corr_s * _ppo_clip(ratio_s, adv_s, cfg)
  pg_loss = jnp.sum(keep_s * ell_s) * inv_n
  loss = pg_loss
  if cfg.kl_coef > 0:
    ref = jnp.where(live, batch_field(batch, "ref_logp", "loss 'gspo' with kl_coef > 0"), 0.0)
    kl_s = agg.seq_sum(kl_estimate(logp, ref, cfg.kl_estimator), batch) * inv_len_s
    loss = loss + cfg.kl_coef * jnp.sum(keep_s * kl_s) * inv_n
  count = sg(n)

  sg_logp = sg(logp_bt)
  ratio_sg = sg(ratio_s)
  seq_metric = lambda x_s: weighted(jnp.sum(keep_s * x_s), n)
  metrics = {"loss": weighted(loss * count, count), "pg_loss": weighted(pg_loss * count, count),
             "nll": agg.token_mean_metric(-sg_logp, batch),
             "ratio_mean": seq_metric(ratio_sg),
             "clip_frac_low": seq_metric(((ratio_sg < 1 - cfg.eps_low) & (adv_s < 0)) * 1.0),
             "clip_frac_high": seq_metric(((ratio_sg > 1 + cfg.eps_high) & (adv_s > 0)) * 1.0)}
  if batch.ref_logp is not None:
    metrics["kl"] = agg.token_mean_metric(
        kl_estimate(sg_logp, jnp.where(live, batch.ref_logp, sg_logp), cfg.kl_estimator), batch)
  metrics.update(off_policy.correction_metrics(
      sg_logp, batch, None if cfg.correction == "none" else corr))
  return loss, metrics


# ------------------------------------------------------------------ m2po

def _m2po_base(cfg: M2POConfig) -> str:
  return "old_logp" if cfg.ratio_base == "old" else "behaviour_logp"


def m2po_inputs(cfg: M2POConfig) -> set[str]:
  return {"old_logp", "behaviour_logp"} | ({"ref_logp"} if cfg.kl_coef > 0 else set())


def _m2po_parts(batch: TrainBatch, cfg: M2POConfig):
  """(PGTerms with c_t = M_t, the [B, T] drop mask)."""
  weight_bt, _ = agg.aggregation_weights(cfg.aggregation, batch, cfg.max_len)
  for field in ("old_logp", "behaviour_logp"):
    batch_field(batch, field, "loss 'm2po' (the second-moment mask)")
  drop = sg(off_policy.second_moment_drop(batch, cfg.tau))
  keep = jnp.where((batch.loss_mask > 0) & ~drop, 1.0, 0.0)
  ref = (batch_field(batch, "ref_logp", "loss 'm2po' with kl_coef > 0")
         if cfg.kl_coef > 0 else None)
  base = batch_field(batch, _m2po_base(cfg), "loss 'm2po'")
  return PGTerms(weight_bt, sg(batch.advantages), keep, base, ref), drop


def m2po_token_terms(batch: TrainBatch, cfg: M2POConfig) -> PGTerms:
  return _m2po_parts(batch, cfg)[0]


def m2po_token_loss(logp: jax.Array, terms: PGTerms, cfg: M2POConfig) -> jax.Array:
  live, logp, base = _prepare(logp, terms)
  ell = terms.corr_bt * (-terms.adv_bt * jnp.exp(logp - base))
  return _with_kl(ell, logp, live, terms, cfg)


@register_loss("m2po", M2POConfig, inputs=m2po_inputs, token_terms=m2po_token_terms,
               token_loss=m2po_token_loss)
def m2po_loss(logp_bt: jax.Array, batch: TrainBatch, cfg: M2POConfig):
  """M2PO loss (mask instead of clip); see the module docstring."""
  terms, drop = _m2po_parts(batch, cfg)
  loss = jnp.sum(m2po_token_loss(logp_bt, terms, cfg))
  _, count = agg.aggregation_weights(cfg.aggregation, batch, cfg.max_len)
  live, logp, base = _prepare(sg(logp_bt), terms)
  ratio = jnp.exp(logp - base)
  pg_loss = jnp.sum(jnp.where(live, terms.weight_bt * terms.corr_bt * -terms.adv_bt * ratio, 0.0))
  sg_logp = sg(logp_bt)
  metrics = {"loss": weighted(loss * count, count), "pg_loss": weighted(pg_loss * count, count),
             "nll": agg.token_mean_metric(-sg_logp, batch),
             "ratio_mean": agg.token_mean_metric(ratio, batch)}
  if batch.ref_logp is not None:
    metrics["kl"] = agg.token_mean_metric(
        kl_estimate(sg_logp, jnp.where(batch.loss_mask > 0, batch.ref_logp, sg_logp),
                    cfg.kl_estimator), batch)
  m = batch.loss_mask
  d = jnp.where(m > 0, jnp.square(batch.old_logp - batch.behaviour_logp), 0.0)
  metrics["m2po/second_moment"] = agg.token_mean_metric(d, batch)
  metrics["m2po/second_moment_kept"] = weighted(jnp.sum(d * terms.corr_bt * m),
                                                jnp.sum(terms.corr_bt * m))
  zeros = jnp.zeros_like(m)
  metrics.update(off_policy.correction_metrics(
      sg_logp, batch, off_policy.CorrectionTerms(terms.corr_bt, zeros,
                                                 jnp.where(m > 0, drop, False).astype(m.dtype))))
  return loss, metrics
