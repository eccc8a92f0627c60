"""Sampled-token KL estimators (k1, k2, k3) and a standalone KL loss.

For a sampled token y_t with learner log-prob log π_θ(y_t) and another policy's log q(y_t)
(reference, teacher, ...), x_t = log q(y_t) − log π_θ(y_t). As *values*, with y ~ π_θ
(J. Schulman, "Approximating KL divergence", 2020):

    k1 = −x                 unbiased estimate of KL(π_θ‖q); can be negative
    k2 = x² / 2             biased (exact to second order in x), ≥ 0, low variance
    k3 = exp(x) − 1 − x     unbiased estimate of KL(π_θ‖q), always ≥ 0, low variance

As a *loss* (the gradient taken through log π_θ(y) only, q constant, y ~ π_θ not
differentiated: how GRPO implementations use them), E_y[∇k] is a different story:

    k1   ∇(−x) = ∇log π_θ(y): E = Σ_y ∇π_θ(y) = 0, whatever q is. No signal toward q, only
         noise: refused as a loss term (KLConfig.estimator, and the GRPO family's
         kl_estimator when kl_coef > 0); it stays available as a metric.
    k2   ∇(x²/2) = (log π_θ − log q)(y) ∇log π_θ(y): E = ∇KL(π_θ‖q), the reverse KL, exactly.
    k3   ∇k3 = (1 − q/π_θ)(y) ∇log π_θ(y): E = −Σ_y q(y)∇log π_θ(y) = ∇KL(q‖π_θ), the
         *forward* KL (mass-covering), although its value estimates the reverse one.

tests/losses/test_losses_kl_gradients.py checks these by exact enumeration over a small vocabulary.
With off-policy samples (y ~ μ ≠ π_θ) each expectation is under μ instead, unweighted.

The standalone loss "kl" is `Σ_t w_t k(x_t)` with w_t from the chosen aggregation
(losses/aggregation.py), q read from the batch field named by `KLConfig.against`. Default
estimator: k2 against a teacher (on-policy distillation minimises the reverse KL(π_θ‖T); k2
is the estimator whose gradient is that one), k3 otherwise (the reference-KL convention of
the GRPO paper, DeepSeekMath 2024, whose gradient is then the forward KL's; unchanged).
Simplifications: only the sampled token enters (no full-vocabulary KL; that lives with the
distillation losses), and no importance weight corrects off-policy samples.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from posttrain_jax.losses import aggregation as agg
from posttrain_jax.losses.base import register_loss, weighted
from posttrain_jax.registry import Registry
from posttrain_jax.types import TrainBatch

KL_ESTIMATORS: Registry[Callable[[jax.Array], jax.Array]] = Registry("kl estimator")
KL_ESTIMATORS.register("k1")(lambda x: -x)
KL_ESTIMATORS.register("k2")(lambda x: 0.5 * x * x)
KL_ESTIMATORS.register("k3")(lambda x: jnp.expm1(x) - x)

# Which TrainBatch field holds log q(y_t) for `KLConfig.against`.
_AGAINST_FIELDS = {"ref": "ref_logp", "teacher": "teacher_logp", "old": "old_logp",
                   "behaviour": "behaviour_logp"}


def check_loss_estimator(estimator: str, field: str) -> None:
  """Config-time check of an estimator used as a loss term: registered, and not k1."""
  KL_ESTIMATORS.get(estimator)
  if estimator == "k1":
    raise ValueError(f"{field}='k1' cannot be a loss term: the gradient of k1 = log π_θ − log q "
                     "is ∇log π_θ, which is zero in expectation and does not depend on q (no "
                     "signal toward q). Use 'k2' (gradient of the reverse KL(π_θ‖q)) or 'k3' "
                     "(gradient of the forward KL(q‖π_θ)); k1 is only a metric")


def kl_estimate(logp: jax.Array, other_logp: jax.Array, estimator: str) -> jax.Array:
  """Per-token k1/k2/k3 with x = other_logp − logp; elementwise, any shape."""
  return KL_ESTIMATORS.get(estimator)(other_logp - logp)


def batch_field(batch: TrainBatch, field: str, why: str) -> jax.Array:
  """A required optional field of the batch, or an error that says who needs it."""
  value = getattr(batch, field)
  if value is None:
    raise ValueError(f"{why} needs batch.{field}, which is None; fill it when building the "
                     "TrainBatch")
  return jax.lax.stop_gradient(value)


@dataclasses.dataclass(frozen=True)
class KLConfig:
  """Standalone sampled-token KL loss."""
  estimator: Optional[str] = None       # "k2" | "k3"; None = k2 against "teacher", else k3
  against: str = "ref"                  # q's batch field: "ref" | "teacher" | "old" | "behaviour"
  aggregation: str = "token_mean"       # a name in losses.aggregation.AGGREGATIONS
  max_len: Optional[int] = None         # L_max, only for aggregation "seq_mean_token_sum_norm"

  def __post_init__(self):
    if self.estimator is not None:
      check_loss_estimator(self.estimator, "KLConfig.estimator")
    if self.against not in _AGAINST_FIELDS:
      raise ValueError(f"KLConfig.against is {self.against!r}; valid: {sorted(_AGAINST_FIELDS)}")
    agg.validate_aggregation(self.aggregation, self.max_len)

  @property
  def resolved_estimator(self) -> str:
    """The estimator in use: `estimator`, or the default for `against` (module docstring)."""
    if self.estimator is not None:
      return self.estimator
    return "k2" if self.against == "teacher" else "k3"


def kl_inputs(cfg: KLConfig) -> tuple[str, ...]:
  return (_AGAINST_FIELDS[cfg.against],)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KLTerms:
  """Per-token constants of the KL loss: aggregation weight (mask included) and log q."""
  weight_bt: jax.Array
  other_logp_bt: jax.Array


def kl_token_terms(batch: TrainBatch, cfg: KLConfig) -> KLTerms:
  weight_bt, _ = agg.aggregation_weights(cfg.aggregation, batch, cfg.max_len)
  other = batch_field(batch, _AGAINST_FIELDS[cfg.against], f"loss 'kl' (against={cfg.against!r})")
  return KLTerms(weight_bt, other)


def kl_token_loss(logp: jax.Array, terms: KLTerms, cfg: KLConfig) -> jax.Array:
  live = terms.weight_bt != 0
  logp = jnp.where(live, logp, terms.other_logp_bt)   # padding may hold any value
  return jnp.where(live, terms.weight_bt * kl_estimate(logp, terms.other_logp_bt,
                                                      cfg.resolved_estimator), 0.0)


@register_loss("kl", KLConfig, inputs=kl_inputs, token_terms=kl_token_terms,
               token_loss=kl_token_loss)
def kl_loss(logp_bt: jax.Array, batch: TrainBatch, cfg: KLConfig):
  """Σ_t w_t k(log q_t − log π_θ,t); metrics: loss, kl_k1/k2/k3 (token means), nll."""
  terms = kl_token_terms(batch, cfg)
  loss = jnp.sum(kl_token_loss(logp_bt, terms, cfg))
  _, count = agg.aggregation_weights(cfg.aggregation, batch, cfg.max_len)
  sg_logp = jax.lax.stop_gradient(logp_bt)
  metrics = {"loss": weighted(loss * count, count), "nll": agg.token_mean_metric(-sg_logp, batch)}
  for name in KL_ESTIMATORS.names():
    metrics[f"kl_{name}"] = agg.token_mean_metric(
        kl_estimate(sg_logp, terms.other_logp_bt, name), batch)
  return loss, metrics
