"""Off-policy corrections: per-token weights that fix the gap between the sampler μ and π_old.

Notation: μ the behaviour policy (`batch.behaviour_logp`, as the engine reported it), π_old /
π_prox the learner before this update (`batch.old_logp`), π_θ the learner now, and
ρ_t = π_old(y_t) / μ(y_t). A correction returns a stop-gradient weight c_t that multiplies the
per-token policy term of a GRPO-family loss (ℓ_t ← c_t · ℓ_t; the KL-to-reference term is not
weighted). Registered corrections, with their defaults:

    none       c_t = 1
    tis        c_t = min(ρ_t, C), C = 2                       truncated IS (Ionides 2008; "Your
                                                              efficient RL framework secretly
                                                              brings you off-policy RL", 2025)
    seq_tis    c_t = min(Π_{t∈i} ρ_t, C), C = 5, one weight per sequence i
    mis        c_t = ρ_t if lo ≤ ρ_t ≤ hi else 0, [0.5, 2]    masked IS; optional veto drops
                                                              the whole sequence if any ρ_t < veto
                                                              (e.g. 1e-4)
    icepop     c_t = ρ_t if α ≤ ρ_t ≤ β else 0, [0.5, 5]      IcePop (Ring-1T; NeMo-RL's range)
    geo_mask   c_t = 1 if lo ≤ exp(mean_{t∈i} log ρ_t) ≤ hi else 0, [0.99, 1.01], per sequence
    decoupled  c_t = ρ_t (= π_prox/μ), 0 where ρ_t > cap      AReaL's decoupled PPO (cap None =
                                                              keep all): with the PPO ratio
                                                              u = π_θ/π_prox this is
                                                              E_μ[(π_prox/μ)·min(uA, clip(u)A)]
    m2po_mask  c_t = 0 for the tokens with the largest        M2PO's second-moment mask
                                                              ("Prosperity before Collapse",
                                                              Zheng et al. 2025); 1 elsewhere
               d_t = (log π_old − log μ)², removed largest first until the mean d of the rest
               is < τ = 0.04. As a correction it multiplies the PPO-clip term, so the ε-clip
               stays: a hybrid, *not* the paper's method. M2PO itself replaces the clip with
               the mask: that is the loss "m2po" (losses/grpo.py).

Everything is computed from batch fields only (`token_terms` time), so a GRPO loss stays
separable in log π_θ. What we simplified, and why:
- M2PO's second moment is taken with the value of log π_θ before the update, i.e. log π_old
  (`old_logp` is required). The mask is not elementwise: it is a statistic of all sampled
  tokens *in the call*, so under gradient accumulation each micro-batch gets its own mask
  (micro-batched ≠ full batch for m2po_mask and the m2po loss only).
- Every correction but "none" needs both `old_logp` and `behaviour_logp`, on both loss paths:
  a missing one is an error, never replaced by stop_gradient(logp).
- `decoupled` masks tokens above the cap (as AReaL's `behav_imp_weight_cap` does) rather than
  truncating them; `tis` is the truncating variant.
- Every weight is a constant (stop-gradient); no V-trace (value baselines are not here).

Reported metrics (all weighted pairs over sampled tokens, prefix "correction/"): abs_logp_diff
= mean |log π_θ − log μ|; kl_behaviour_k3 = mean of exp(x) − 1 − x with x = log π_θ − log μ
(a sample estimate of KL(μ‖π_θ), the samples being μ's); is_weight_mean; is_weight_min and
is_weight_max as (value, 1) pairs (count 0 when no token) — summed over K micro-batches they
give the mean of the per-micro-batch extremes, so a logger wanting exact extremes reduces keys
ending in _min / _max with min / max; clip_frac (weight truncated) and mask_frac (weight 0).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from posttrain_jax.losses import aggregation as agg
from posttrain_jax.losses.base import Metrics, weighted
from posttrain_jax.registry import Registry
from posttrain_jax.types import TrainBatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CorrectionTerms:
  """What a correction gives the loss, every field [B, T] and 0 off the mask."""
  weight_bt: jax.Array    # stop-gradient multiplier c_t of the token's policy term
  clipped_bt: jax.Array   # 1 where the weight was truncated at a cap
  masked_bt: jax.Array    # 1 where the policy term was dropped (c_t = 0 by the rule)


@dataclasses.dataclass(frozen=True)
class CorrectionSpec:
  """A registered correction: its config class and `terms(batch, cfg) -> CorrectionTerms`."""
  name: str
  config_cls: type
  terms: Callable[[TrainBatch, Any], CorrectionTerms]
  needs_logps: bool = True    # reads batch.old_logp and batch.behaviour_logp


CORRECTIONS: Registry[CorrectionSpec] = Registry("off-policy correction")


def register_correction(name: str, config_cls: type, *, needs_logps: bool = True):
  def deco(fn):
    CORRECTIONS.register(name)(CorrectionSpec(name, config_cls, fn, needs_logps))
    return fn
  return deco


# ------------------------------------------------------------------ configs (one per correction)

@dataclasses.dataclass(frozen=True)
class NoCorrection:
  """No correction: c_t = 1."""


@dataclasses.dataclass(frozen=True)
class TISConfig:
  """Token-level truncated importance sampling."""
  cap: float = 2.0                      # C: c_t = min(ρ_t, C)


@dataclasses.dataclass(frozen=True)
class SeqTISConfig:
  """Sequence-level truncated importance sampling."""
  cap: float = 5.0                      # C: c_i = min(Π_t ρ_t, C), one weight per sequence


@dataclasses.dataclass(frozen=True)
class MISConfig:
  """Masked importance sampling."""
  low: float = 0.5                      # keep ρ_t only if low ≤ ρ_t
  high: float = 2.0                     # ... and ρ_t ≤ high; else c_t = 0
  veto: Optional[float] = None          # drop the whole sequence if any ρ_t < veto (e.g. 1e-4)


@dataclasses.dataclass(frozen=True)
class IcePopConfig:
  """IcePop: ρ_t inside [low, high] is kept as the weight, outside it the token is dropped."""
  low: float = 0.5                      # α (SkyRL and NeMo-RL: 0.5)
  high: float = 5.0                     # β (NeMo-RL 5.0; SkyRL 2.0)


@dataclasses.dataclass(frozen=True)
class GeoMaskConfig:
  """Geometric-mean sequence mask."""
  low: float = 0.99                     # drop sequence i if exp(mean_t log ρ_t) < low
  high: float = 1.01                    # ... or > high (tighter settings: [0.999, 1.002])


@dataclasses.dataclass(frozen=True)
class DecoupledConfig:
  """AReaL decoupled PPO: behaviour weight π_prox/μ on the PPO term clipped around π_prox."""
  cap: Optional[float] = None           # drop tokens with π_prox/μ > cap; None keeps all


@dataclasses.dataclass(frozen=True)
class M2POMaskConfig:
  """M2PO's second-moment token mask, applied on top of the PPO clip (see "m2po_mask")."""
  tau: float = 0.04                     # τ: drop largest (log π_old − log μ)² until mean < τ

  def __post_init__(self):
    if not self.tau > 0:
      raise ValueError(f"M2POMaskConfig.tau must be > 0, got {self.tau}")


def resolve(name: str, cfg: Any) -> tuple[CorrectionSpec, Any]:
  """The spec of `name` and its config (defaults when `cfg` is None); checks the type."""
  if name == "m2po":
    raise ValueError("correction 'm2po' was renamed: the M2PO paper's method (mask instead of "
                     "the ε-clip) is the loss 'm2po' (LearnerConfig.loss='m2po', M2POConfig); "
                     "the mask on top of the PPO clip is correction 'm2po_mask'")
  spec = CORRECTIONS.get(name)
  if cfg is None:
    return spec, spec.config_cls()
  if not isinstance(cfg, spec.config_cls):
    raise TypeError(f"correction {name!r} takes a {spec.config_cls.__name__}, got "
                    f"{type(cfg).__name__}; pass correction_cfg={spec.config_cls.__name__}(...)")
  return spec, cfg


def correction_inputs(name: str) -> frozenset[str]:
  """The batch fields correction `name` reads (for `LossSpec.needs`)."""
  if CORRECTIONS.get(name).needs_logps:
    return frozenset({"old_logp", "behaviour_logp"})
  return frozenset()


def correction_terms(name: str, cfg: Any, batch: TrainBatch, why: str) -> CorrectionTerms:
  """c_t for `batch`; `why` names the loss in error messages."""
  spec, cfg = resolve(name, cfg)
  for field in sorted(correction_inputs(name)):
    if getattr(batch, field) is None:
      raise ValueError(
          f"{why} with correction {name!r} needs batch.{field}, which is None; fill it when "
          "building the TrainBatch (old_logp: the learner's log-probs before the update)")
  terms = spec.terms(batch, cfg)
  return jax.tree_util.tree_map(jax.lax.stop_gradient, terms)


def _log_rho(batch: TrainBatch) -> jax.Array:
  """log ρ_t = log π_old − log μ on sampled tokens, 0 elsewhere."""
  live = batch.loss_mask > 0
  return jnp.where(live, batch.old_logp - batch.behaviour_logp, 0.0)


def _terms(batch, weight, clipped, masked) -> CorrectionTerms:
  m = batch.loss_mask
  f = lambda x: jnp.where(m > 0, jnp.asarray(x, jnp.result_type(float)), 0.0)
  return CorrectionTerms(f(weight), f(clipped), f(masked))


# ------------------------------------------------------------------ the corrections

@register_correction("none", NoCorrection, needs_logps=False)
def _none(batch: TrainBatch, cfg: NoCorrection) -> CorrectionTerms:
  zeros = jnp.zeros_like(batch.loss_mask)
  return _terms(batch, jnp.ones_like(batch.loss_mask), zeros, zeros)


@register_correction("tis", TISConfig)
def _tis(batch: TrainBatch, cfg: TISConfig) -> CorrectionTerms:
  rho = jnp.exp(_log_rho(batch))
  return _terms(batch, jnp.minimum(rho, cfg.cap), rho > cfg.cap, False)


@register_correction("seq_tis", SeqTISConfig)
def _seq_tis(batch: TrainBatch, cfg: SeqTISConfig) -> CorrectionTerms:
  log_rho_s = agg.seq_sum(_log_rho(batch), batch)            # log Π_t ρ_t
  log_cap = jnp.log(cfg.cap)
  weight_s = jnp.exp(jnp.minimum(log_rho_s, log_cap))       # never overflows
  return _terms(batch, agg.seq_gather(weight_s, batch),
                agg.seq_gather((log_rho_s > log_cap).astype(jnp.float32), batch), False)


def _masked_rho(batch, low, high):
  rho = jnp.exp(_log_rho(batch))
  keep = (rho >= low) & (rho <= high)
  return rho, keep


@register_correction("mis", MISConfig)
def _mis(batch: TrainBatch, cfg: MISConfig) -> CorrectionTerms:
  rho, keep = _masked_rho(batch, cfg.low, cfg.high)
  if cfg.veto is not None:
    vetoed_s = agg.seq_sum((rho < cfg.veto).astype(jnp.float32), batch) > 0
    keep = keep & (agg.seq_gather(vetoed_s.astype(jnp.float32), batch) == 0)
  return _terms(batch, jnp.where(keep, rho, 0.0), False, ~keep)


@register_correction("icepop", IcePopConfig)
def _icepop(batch: TrainBatch, cfg: IcePopConfig) -> CorrectionTerms:
  rho, keep = _masked_rho(batch, cfg.low, cfg.high)
  return _terms(batch, jnp.where(keep, rho, 0.0), False, ~keep)


@register_correction("geo_mask", GeoMaskConfig)
def _geo_mask(batch: TrainBatch, cfg: GeoMaskConfig) -> CorrectionTerms:
  len_s = agg.seq_lengths(batch)
  geo_s = jnp.exp(agg.seq_sum(_log_rho(batch), batch) / jnp.maximum(len_s, 1.0))
  keep_s = ((geo_s >= cfg.low) & (geo_s <= cfg.high)).astype(jnp.float32)
  keep_bt = agg.seq_gather(keep_s, batch)
  return _terms(batch, keep_bt, False, 1.0 - keep_bt)


@register_correction("decoupled", DecoupledConfig)
def _decoupled(batch: TrainBatch, cfg: DecoupledConfig) -> CorrectionTerms:
  rho = jnp.exp(_log_rho(batch))
  if cfg.cap is None:
    return _terms(batch, rho, False, False)
  keep = rho <= cfg.cap
  return _terms(batch, jnp.where(keep, rho, 0.0), False, ~keep)


def second_moment_drop(batch: TrainBatch, tau: float) -> jax.Array:
  """M2PO's mask, inverted: 1 on the sampled tokens to drop, [B, T] bool.

  d_t = (log π_old − log μ)²; tokens are removed largest d first until the mean d of the
  sampled tokens left is < τ (all of them may go). Needs old_logp and behaviour_logp.
  """
  live = (batch.loss_mask > 0).ravel()
  d = jnp.square(_log_rho(batch)).ravel()
  n_flat = d.shape[0]
  order = jnp.argsort(jnp.where(live, -d, jnp.inf))   # sampled tokens, largest d first
  d_sorted = jnp.where(live[order], d[order], 0.0)
  # rest_sum[k] = Σ of d over sorted positions ≥ k (the tokens left after dropping k).
  rest_sum = jnp.concatenate([jnp.cumsum(d_sorted[::-1])[::-1], jnp.zeros((1,), d.dtype)])
  n_live = jnp.sum(live)
  rest_count = n_live - jnp.arange(n_flat + 1)
  ok = (rest_count <= 0) | (rest_sum < tau * rest_count)
  n_drop = jnp.argmax(ok)                              # the first k where the rest's mean < τ
  rank = jnp.zeros((n_flat,), jnp.int32).at[order].set(jnp.arange(n_flat, dtype=jnp.int32))
  return (live & (rank < n_drop)).reshape(batch.loss_mask.shape)


@register_correction("m2po_mask", M2POMaskConfig)
def _m2po_mask(batch: TrainBatch, cfg: M2POMaskConfig) -> CorrectionTerms:
  drop = second_moment_drop(batch, cfg.tau)
  return _terms(batch, ~drop, False, drop)


# ------------------------------------------------------------------ metrics

def correction_metrics(logp_bt: jax.Array, batch: TrainBatch,
                       terms: Optional[CorrectionTerms]) -> Metrics:
  """The diagnostics of the module docstring; weight stats only when `terms` is given."""
  m = batch.loss_mask
  live = m > 0
  out: Metrics = {}
  if batch.behaviour_logp is not None:
    x = jnp.where(live, jax.lax.stop_gradient(logp_bt) - batch.behaviour_logp, 0.0)
    out["correction/abs_logp_diff"] = agg.token_mean_metric(jnp.abs(x), batch)
    out["correction/kl_behaviour_k3"] = agg.token_mean_metric(jnp.expm1(x) - x, batch)
  if terms is not None:
    w = terms.weight_bt
    any_tok = (jnp.sum(m) > 0).astype(jnp.float32)
    out["correction/is_weight_mean"] = agg.token_mean_metric(w, batch)
    out["correction/is_weight_min"] = weighted(
        jnp.where(any_tok > 0, jnp.min(jnp.where(live, w, jnp.inf)), 0.0), any_tok)
    out["correction/is_weight_max"] = weighted(
        jnp.where(any_tok > 0, jnp.max(jnp.where(live, w, -jnp.inf)), 0.0), any_tok)
    out["correction/clip_frac"] = agg.token_mean_metric(terms.clipped_bt, batch)
    out["correction/mask_frac"] = agg.token_mean_metric(terms.masked_bt, batch)
  return out
