"""One LoRA adapter per tenant on one frozen base (`LearnerConfig.lora.tenants`).

The learner's TrainState holds every tenant's adapters, optimizer moments, step count and rng
stacked on a leading axis of size T (tenants in the order named); a step trains one tenant i:

    s_i  = state[i]                          (every leaf's row i)
    s_i' = train_step(s_i, batch, frozen)    the ordinary LoRA step (learner.py)
    state' = state with row i replaced by s_i'

in one jitted program whose index is traced, so all tenants share one compiled step. The other
rows are the same bits after the step: their AdamW momentum does not move them, their step
count does not advance (a tenant's step count is its policy version). A checkpoint saves the
stack as one TrainState; the base is shared, never copied.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def stacked_sharding(sharding: Any) -> Any:
  """The sharding of a [T, ...] stack of arrays sharded as `sharding`: the tenant axis whole."""
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, P(None, *sharding.spec))
  return sharding


def stack(tree: Any, n: int) -> Any:
  """`n` copies of every leaf of `tree` on a new leading axis (each tenant starts the same)."""
  return jax.tree.map(lambda x: jnp.stack([x] * n), tree)


def stack_abstract(tree: Any, n: int) -> Any:
  """`stack` of ShapeDtypeStructs (restore targets): [n, ...] shapes, tenant axis unsharded."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
      (n,) + tuple(a.shape), a.dtype, sharding=stacked_sharding(getattr(a, "sharding", None))),
      tree)


def take(tree: Any, i) -> Any:
  """Row `i` of every leaf: one tenant's state (new arrays, not views of the stack)."""
  return jax.tree.map(lambda x: x[i], tree)


def put(tree: Any, i, row: Any) -> Any:
  """`tree` with row `i` of every leaf replaced by `row`'s leaf."""
  return jax.tree.map(lambda x, r: x.at[i].set(r), tree, row)


def tenant_step(step: Callable) -> Callable:
  """`step(state, batch, teacher_w, frozen) -> (state, metrics)` on one tenant's state, as a
  step on the stack: `(stack, batch, teacher_w, frozen, index) -> (stack, metrics)`."""
  def run(state, batch, teacher_w=None, frozen=None, index=0):
    new, metrics = step(take(state, index), batch, teacher_w, frozen)
    return put(state, index, new), metrics
  return run


def tenant_index(tenants: tuple[str, ...], tenant: str) -> int:
  """The row of `tenant`; a KeyError naming the tenants there are."""
  try:
    return tenants.index(tenant)
  except ValueError:
    raise KeyError(f"tenant {tenant!r} has no adapter; lora.tenants = {list(tenants)}") from None


def check_tenants(tenants: tuple[str, ...], field: str = "LoRAConfig.tenants") -> Optional[str]:
  """None, or why `tenants` is not a valid list of adapter names."""
  if len(set(tenants)) != len(tenants):
    return f"{field} names a tenant twice: {list(tenants)}"
  bad = [t for t in tenants if not isinstance(t, str) or not t]
  if bad:
    return f"{field} must be non-empty strings, got {bad}"
  return None


__all__ = ["stack", "stack_abstract", "stacked_sharding", "take", "put", "tenant_step",
           "tenant_index", "check_tenants"]
