"""What the processes of a multi-process (multi-host) JAX job exchange outside the jitted step.

JAX's multi-controller model: every process runs the same program, each holds the rows of the
global batch that live on its own devices, and a collective is entered by every process or the
job hangs. So anything a process computes from its own data and that must be the same
everywhere (a batch shape, whether a step trains at all, a metric that is logged) goes through
one of these, called by every process at the same point:

  all_gather_json(x)      every process's JSON-able value, in process order (a checkpoint's
                          per-process side-car, metrics)
  max_over_processes(v)   the element-wise max of a few ints (a trimmed batch's shape)
  share(total, what)      this process's part of a global count (prompts, rows), which must
                          divide evenly: the same config means the same global batch on any
                          number of processes

With one process each is the identity and costs nothing.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

import jax
import numpy as np

from posttrain_jax.errors import UserError


class ProcessShareError(UserError, ValueError):
  """A global count that the processes of the job cannot split evenly."""


def all_gather_json(value: Any) -> list:
  """[value of process 0, value of process 1, ...] on every process (`value`: JSON-able)."""
  if jax.process_count() == 1:
    return [json.loads(json.dumps(value))]
  from jax.experimental import multihost_utils
  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int64)))
  sizes = sizes.reshape(-1)
  padded = np.zeros((int(sizes.max()),), np.uint8)
  padded[:data.size] = data
  gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
  return [json.loads(bytes(row[:n]).decode()) for row, n in zip(gathered, sizes)]


def max_over_processes(values: Sequence[int]) -> tuple[int, ...]:
  """The element-wise max of `values` (ints) over the processes of the job: what every
  process must use where each computed its own (e.g. a trimmed batch's shape, which the
  jitted step and its collectives need the same everywhere). One process: `values` itself."""
  if jax.process_count() == 1:
    return tuple(int(v) for v in values)
  from jax.experimental import multihost_utils
  gathered = multihost_utils.process_allgather(np.asarray(values, np.int64))
  return tuple(int(v) for v in np.max(np.asarray(gathered).reshape(jax.process_count(), -1), 0))


def share(total: int, what: str) -> int:
  """This process's part of the global count `total` (total / process_count), or an error
  naming `what` (a config field) when the processes cannot split it evenly."""
  n = jax.process_count()
  if total % n:
    raise ProcessShareError(f"{what}={total} must be a multiple of the {n} processes of the job "
                            f"(each process feeds {what} / {n} of the global batch)")
  return total // n


def mean_over_processes(metrics: dict[str, float]) -> dict[str, float]:
  """Each metric averaged over the processes that report it (every process gets the same
  dict). A value every process computed identically (the learner's loss) is unchanged."""
  if jax.process_count() == 1:
    return dict(metrics)
  rows = all_gather_json({k: (None if v != v else float(v)) for k, v in metrics.items()})
  out = {}
  for key in dict.fromkeys(k for row in rows for k in row):
    vals = [row[key] for row in rows if key in row and row[key] is not None]
    out[key] = (float("nan") if not vals else vals[0] if len(set(vals)) == 1
                else float(np.mean(vals)))
  return out


def put_global(tree, shardings):
  """`jax.device_put(tree, shardings)` that also works across processes: there a value held
  by this process alone (a fresh `jnp.zeros`, a PRNG key) cannot be put onto devices of other
  processes, so it goes through host memory (every process holds the same value: the program
  is the same everywhere); arrays already laid out over the job pass through unchanged."""
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)

  def put(x, sharding):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return x if x.sharding == sharding else jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      data = jax.device_put(np.asarray(jax.random.key_data(x)), sharding)
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(np.asarray(x), sharding)
  return jax.tree.map(put, tree, shardings)
