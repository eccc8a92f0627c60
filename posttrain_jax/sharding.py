"""Device mesh, logical-axis rules, and sharding helpers.

Parameters and key activations carry *logical* axis names (``"embed"``, ``"mlp"``,
``"heads"``, ``"vocab"``, ``"batch"`` ...; a LoRA adapter the projection's own axis and
``"lora_rank"``). One rules table maps each logical name to a mesh
axis (or a tuple of mesh axes, or None for replicated). Models never name mesh axes.

The mesh has three axes: ``data`` (pure data parallel: replicated params), ``fsdp`` (data
parallel with parameters sharded along ``embed``), ``tensor`` (Megatron-style: heads / mlp /
vocab sharded). A dimension that a mesh axis does not divide is replicated on that axis
rather than padded (``logical_to_spec``), so odd tiny models still run on any mesh.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Logical name -> mesh axis / axes / None. The single table; override per run via MeshConfig.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    # parameters
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("norm", None),
    ("head_dim", None),
    ("lora_rank", None),   # LoRA adapters' inner dimension r (models/lora.py): small, replicated
    # activations
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("cache_length", None),
)


class MeshError(ValueError):
  """The requested mesh does not fit the devices."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh shape; at most one axis may be -1 ("all remaining devices")."""
  data: int = 1          # pure data-parallel replicas
  fsdp: int = -1         # data parallel with params sharded along "embed"
  tensor: int = 1        # tensor parallel over heads / mlp / vocab
  rules: tuple[tuple[str, Any], ...] = DEFAULT_RULES  # logical name -> mesh axis table


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
  """Resolves -1 and checks that the product equals `num_devices`."""
  sizes = [cfg.data, cfg.fsdp, cfg.tensor]
  for name, s in zip(MESH_AXES, sizes):
    if s == 0 or s < -1:
      raise MeshError(f"mesh axis {name!r} has size {s}; use a positive size or -1")
  if sizes.count(-1) > 1:
    raise MeshError(f"mesh {dict(zip(MESH_AXES, sizes))}: at most one axis may be -1")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise MeshError(
          f"mesh {dict(zip(MESH_AXES, sizes))}: the fixed axes (product {known}) do not divide "
          f"the {num_devices} devices")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise MeshError(
        f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices but there are "
        f"{num_devices}; make the product of data x fsdp x tensor equal {num_devices} or set one "
        "axis to -1")
  return tuple(sizes)


def make_mesh(cfg: MeshConfig = MeshConfig(), devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """Builds the (data, fsdp, tensor) mesh over `devices` (default: all global devices)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(cfg, len(devices))
  # Auto axes: GSPMD propagates shardings; we constrain parameters and key activations.
  auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  if devices == list(jax.devices()):
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)


def logical_to_spec(axes: Sequence[Optional[str]], rules=DEFAULT_RULES,
                    mesh: Optional[Mesh] = None, shape: Optional[Sequence[int]] = None
                    ) -> PartitionSpec:
  """Maps logical axis names to a PartitionSpec through `rules`.

  With `mesh` and `shape` given, a dimension the mapped mesh axes do not divide is
  replicated, and a mesh axis is used at most once (first dimension wins).
  """
  table = dict(rules)
  used: set[str] = set()
  out = []
  for i, name in enumerate(axes):
    target = table.get(name) if name is not None else None
    if name is not None and name not in table:
      raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(table)}")
    mesh_axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
    mesh_axes = tuple(a for a in mesh_axes if a not in used)
    if mesh is not None:
      mesh_axes = tuple(a for a in mesh_axes if mesh.shape[a] > 1)
      if shape is not None and mesh_axes:
        size = math.prod(mesh.shape[a] for a in mesh_axes)
        if shape[i] % size:
          mesh_axes = ()
    used.update(mesh_axes)
    out.append(None if not mesh_axes else (mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes))
  return PartitionSpec(*out)


def named_sharding(mesh: Mesh, axes, shape=None, rules=DEFAULT_RULES) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(axes, rules, mesh, shape))


def shard(x: jax.Array, axes: Sequence[Optional[str]], mesh: Optional[Mesh],
          rules=DEFAULT_RULES) -> jax.Array:
  """Constrains activation `x` to its logical sharding; a no-op without a mesh."""
  if mesh is None or mesh.size == 1:
    return x
  return jax.lax.with_sharding_constraint(x, named_sharding(mesh, axes, x.shape, rules))


def cluster_environment(env: Optional[dict] = None) -> Optional[tuple[str, int]]:
  """(name, processes) of the multi-process job this process was started in, read from the
  environment the way jax.distributed's auto-detection reads it, or None for a lone process:
  JAX_NUM_PROCESSES (launch/local.py), SLURM (SLURM_NTASKS), Open MPI (OMPI_COMM_WORLD_SIZE),
  a Cloud TPU pod slice (TPU_WORKER_HOSTNAMES, one per host)."""
  env = os.environ if env is None else env
  found = []
  if "JAX_NUM_PROCESSES" in env:
    found.append(("JAX_NUM_PROCESSES", int(env["JAX_NUM_PROCESSES"])))
  if "SLURM_JOB_ID" in env and "SLURM_NTASKS" in env:
    found.append(("SLURM", int(env["SLURM_NTASKS"])))
  if "OMPI_COMM_WORLD_SIZE" in env:
    found.append(("Open MPI", int(env["OMPI_COMM_WORLD_SIZE"])))
  hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
  if hosts:
    found.append(("Cloud TPU pod slice", len(hosts)))
  return next(((name, n) for name, n in found if n > 1), None)


def initialize_distributed(coordinator_address: Optional[str] = None,
                           num_processes: Optional[int] = None,
                           process_id: Optional[int] = None,
                           local_device_ids: Optional[Sequence[int]] = None,
                           auto_detect: bool = False) -> bool:
  """Joins a multi-process JAX job (call before any other JAX call); True if it joined one.

  Arguments default to the environment (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
  ``JAX_PROCESS_ID``: what `launch/local.py` sets). Where those are unset too, `auto_detect`
  lets JAX find the job from its cluster (SLURM, Cloud TPU pod slices, Open MPI, ...); without
  it a single process with nothing set is a no-op.
  """
  env = os.environ
  coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
  if num_processes is None and "JAX_NUM_PROCESSES" in env:
    num_processes = int(env["JAX_NUM_PROCESSES"])
  if process_id is None and "JAX_PROCESS_ID" in env:
    process_id = int(env["JAX_PROCESS_ID"])
  if coordinator_address is None and num_processes in (None, 1) and not auto_detect:
    return False
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             local_device_ids=local_device_ids)
  return True
