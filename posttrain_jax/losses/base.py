"""The loss protocol and its registry.

A loss is a pure function

    fn(logp_bt, batch: TrainBatch, cfg) -> (loss, metrics)

`logp_bt` is the learner's per-token log-prob of `batch.target_ids` ([B, T], differentiable).
`loss` is the scalar normalised *within this batch* and `metrics["loss"] == (loss * count, count)`
where `count` (the normaliser: tokens, sequences, ...) does not depend on parameters. Every
metric is a weighted pair `(sum, count)` so that gradient accumulation over micro-batches is
exact: the learner differentiates `loss * count`, sums over micro-batches and divides by the
summed count.

A loss is *separable* when its value is a sum of per-token terms, each depending on `logp`
only through that token's own `logp_t`:

    loss = sum_t token_loss(logp_t, aux_t, cfg),   aux = token_terms(batch, cfg)

`token_terms` precomputes everything that needs the whole batch (advantages, normalising
weights, masks) as `[B, T]` arrays; `token_loss` is elementwise and works on any shape. The
fused LM-head kernel uses this form to compute gradients during its forward pass.

Head losses. A loss that needs the whole next-token distribution, not only the sampled token's
log-prob (full-distribution distillation), registers with `head=True` and is called as

    fn(head: HeadInputs, batch, cfg) -> (loss, metrics)

with the final hidden states h [N = B*T, D], the LM head W and the sampling temperature; it
computes what it needs through the LM-head kernels (kernels/teacher.py), never [N, V]. It is
never separable and the learner's `logprobs()` does not apply to it.

Inputs. Every loss declares which optional TrainBatch fields (`behaviour_logp`, `old_logp`,
`ref_logp`, `teacher_logp`, `teacher_mask`) it needs for a given config: `register_loss(..., inputs=...)`
takes a static tuple of field names or a function `cfg -> iterable of names`, and
`spec.needs(cfg)` returns them as a frozenset. The learner loop computes exactly those
fields (a reference forward pass for `ref_logp`, the pre-update forward pass for `old_logp`).
The contract, on both paths (`fn` and `token_terms`):
- a field in `needs(cfg)` is read; when it is None the loss raises a ValueError that names
  the field and the loss (it never substitutes a value);
- a field outside `needs(cfg)` may be None and the loss works. Where such a field is given
  anyway, only two things may read it: `old_logp` in the policy-gradient family (grpo, cispo,
  gspo: absent means on-policy, π_old = stop_gradient(π_θ), which is what a recomputed
  `old_logp` equals before the first update; a multi-epoch loop fills it to keep π_old fixed),
  and diagnostics metrics (e.g. `kl` from `ref_logp`, `correction/abs_logp_diff` from
  `behaviour_logp`). The loss value and gradient never depend on any other extra field.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

from posttrain_jax.registry import Registry
from posttrain_jax.types import TrainBatch

Metrics = dict[str, tuple[jax.Array, jax.Array]]
LossFn = Callable[..., tuple[jax.Array, Metrics]]
Inputs = Union[Callable[[Any], Iterable[str]], tuple[str, ...]]

# The TrainBatch fields a loss may need: the optional (default None) ones, less the optional
# layout (prefix_ids: which slots a position attends, read by the model, never by a loss).
OPTIONAL_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainBatch)
                            if f.default is None and f.name != "prefix_ids")


def _checked_fields(loss: str, names: Iterable[str]) -> frozenset[str]:
  if isinstance(names, str):
    raise TypeError(f"loss {loss!r}: inputs must be an iterable of field names, got the string "
                    f"{names!r}; write ({names!r},)")
  out = frozenset(names)
  bad = sorted(out - OPTIONAL_FIELDS)
  if bad:
    raise ValueError(f"loss {loss!r} declares inputs {bad}, which are not optional TrainBatch "
                     f"fields; valid: {sorted(OPTIONAL_FIELDS)}")
  return out


class HeadInputs(NamedTuple):
  """What a head loss gets instead of log-probs: h [N, D] (rows of the batch flattened), the LM
  head W ([D, V], or [V, D] with transposed), the softmax temperature, and the teacher's own
  head when it has one (an EMA or frozen teacher; None: the teacher's head is W itself)."""
  h: jax.Array
  w: jax.Array
  transposed: bool
  temperature: float
  teacher_w: Optional[jax.Array] = None


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """A registered loss: the function, its config class and, if separable, its per-token form."""
  name: str
  fn: LossFn
  config_cls: type
  token_terms: Optional[Callable[[Any, Any], Any]] = None       # (batch, cfg) -> aux pytree of [B, T]
  token_loss: Optional[Callable[[jax.Array, Any, Any], jax.Array]] = None  # (logp, aux, cfg) -> ell
  inputs: Inputs = ()             # optional batch fields needed: names, or cfg -> names
  head: bool = False              # fn takes HeadInputs instead of log-probs (module docstring)

  @property
  def separable(self) -> bool:
    return self.token_loss is not None

  def needs(self, cfg) -> frozenset[str]:
    """The optional TrainBatch fields this loss reads under `cfg` (see the module docstring)."""
    if not isinstance(cfg, self.config_cls):
      raise TypeError(f"loss {self.name!r} takes a {self.config_cls.__name__}, got "
                      f"{type(cfg).__name__}")
    return _checked_fields(self.name, self.inputs(cfg) if callable(self.inputs) else self.inputs)


LOSSES: Registry[LossSpec] = Registry("loss")


def register_loss(name: str, config_cls: type, *, inputs: Inputs, token_terms=None,
                  token_loss=None, head: bool = False):
  """Decorator: `@register_loss("grpo", GRPOConfig, inputs=grpo_inputs, token_terms=...,
  token_loss=...)`. `inputs` is required: a tuple of optional TrainBatch field names, or a
  function `cfg -> iterable of names` (`()` for a loss that needs none)."""
  if (token_terms is None) != (token_loss is None):
    raise ValueError(f"loss {name!r}: give both token_terms and token_loss, or neither")
  if head and token_loss is not None:
    raise ValueError(f"loss {name!r}: a head loss is not separable (no token_terms/token_loss)")
  if not callable(inputs):
    inputs = tuple(sorted(_checked_fields(name, inputs)))

  def deco(fn: LossFn) -> LossFn:
    LOSSES.register(name)(LossSpec(name, fn, config_cls, token_terms, token_loss, inputs, head))
    return fn
  return deco


def get_loss(name: str) -> LossSpec:
  return LOSSES.get(name)


def weighted(total: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A metric as a (sum, count) pair, both float32 scalars, gradients stopped."""
  return (jax.lax.stop_gradient(jnp.asarray(total, jnp.float32)),
          jax.lax.stop_gradient(jnp.asarray(count, jnp.float32)))
