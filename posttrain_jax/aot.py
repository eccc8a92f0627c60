"""Ahead-of-time memory check: compile the train step against abstract shapes, read its memory.

Nothing is allocated: the model is built with `nnx.eval_shape`, the TrainState and the batch
are `jax.ShapeDtypeStruct`s carrying the shardings the Learner would give them, and
`jax.jit(train_step).lower(...).compile()` only compiles. `compiled.memory_analysis()` is
per device (the SPMD-partitioned program), and the total we compare with the capacity is

    total = arguments + (outputs − aliased) + temporaries + generated code + reference params

arguments   params, optimizer state, batch, step and rng: read from the compiler, and split
            exactly by the shard shape of each leaf (`sharding.shard_shape`);
outputs     the new state is donated, so it aliases the old one; what is left is the metrics;
temporaries gradients, activations, the LM-head loss's scratch (one buffer-assignment peak);
            split by estimate: gradients = the params' shard bytes (×2 with micro-batches: the
            accumulator and the current micro-batch's), loss scratch = the temporaries of the
            fused LM-head loss compiled alone on one micro-batch, activations = the rest. With
            fsdp "the rest" also holds each layer's all-gathered weights when the compiler
            keeps them from the forward pass for the backward (measured: Qwen3-8B's row is
            56 GiB with 1 or with 2 rows of 1024 tokens per device, so mostly weights);
reference   the frozen start weights the RL phase keeps for ref_logp / the KL metric
            (`rl.reference_kl`), resident beside the step, sharded like the params.
LoRA        (`learner.lora.rank` > 0) params and optimizer state are the adapters'; the frozen
            base is an argument of its own (exact), and the reference is the base with the
            adapters at zero: the adapters' bytes again, not a copy of the base.

Capacity: the device's memory (`DEVICE_MEMORY_GIB` by kind, or what the user gives) less what
an in-process vLLM on the same GPUs takes (`gpu_memory_utilization` of it). On fake CPU devices
the numbers are the CPU compiler's buffer assignment for the same program: a close stand-in for
the target's (parameters, optimizer state and batch are exact; temporaries depend on the
backend's fusion), and there is no real capacity, so the target is named by the user.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from posttrain_jax.errors import UserError
from posttrain_jax.engines.registry import engine_spec
from posttrain_jax.learner import (LearnerConfig, abstract_frozen, abstract_train_state,
                                   make_optimizer, split_micro_batches, train_step)
from posttrain_jax.losses import get_loss
from posttrain_jax.models import hf_io, lora
from posttrain_jax.models.config import ModelConfig
from posttrain_jax.types import TrainBatch

GIB = 1 << 30
# Memory per device, GiB, as the vendors quote it (H100 80 GB = 79.6 GiB visible, H200 141 GB).
DEVICE_MEMORY_GIB = {"h200": 141.0, "h100": 80.0, "v5e": 16.0, "v5p": 95.0}
_KIND_NAMES = (("h200", "h200"), ("h100", "h100"), ("v5 lite", "v5e"), ("v5e", "v5e"),
               ("v5p", "v5p"), ("tpu v5", "v5p"))


class AOTError(UserError, ValueError):
  """A config the AOT check cannot compile (or that does not fit); the message names the field."""


def device_kind(device: jax.Device) -> Optional[str]:
  """'h200' | 'h100' | 'v5e' | 'v5p' for a real device of a kind we know, else None."""
  name = getattr(device, "device_kind", "").lower()
  return next((kind for key, kind in _KIND_NAMES if key in name), None)


def _shard_bytes(x) -> int:
  """Bytes one device holds of a ShapeDtypeStruct (its shard shape under its sharding)."""
  shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
  return math.prod(shape) * jnp.dtype(x.dtype).itemsize


def tree_bytes(tree) -> int:
  return sum(_shard_bytes(x) for x in jax.tree.leaves(tree))


def batch_fields(loss: str, loss_cfg, *, reference: bool, update_epochs: int) -> set[str]:
  """The optional TrainBatch fields the RL step fills (rl_step.py): the loss's needs, old_logp
  for several epochs, ref_logp with a reference, behaviour_logp always (build_batch)."""
  needs = set(get_loss(loss).needs(loss_cfg)) | {"behaviour_logp"}
  if update_epochs > 1:
    needs.add("old_logp")
  if reference:
    needs.add("ref_logp")
  teacher = needs & {"teacher_logp", "teacher_mask", "teacher_hidden"}
  if teacher:
    raise AOTError(f"loss {loss!r} reads {sorted(teacher)}: the AOT check compiles steps without "
                   "a teacher; check a non-distillation loss")
  return needs


def abstract_batch(rows: int, seq_len: int, max_seqs: int, fields: set[str],
                   mesh: Mesh) -> TrainBatch:
  """The TrainBatch `Learner.put_batch` would give the step: rows split over (data, fsdp)."""
  split = mesh.shape["data"] * mesh.shape["fsdp"]
  if rows % split:
    raise AOTError(f"rl.batch.rows={rows} is not a multiple of mesh data × fsdp = {split}: the "
                   "rows are split over those axes")
  rows_sh, rep = NamedSharding(mesh, P(("data", "fsdp"))), NamedSharding(mesh, P())
  bt = lambda dtype: jax.ShapeDtypeStruct((rows, seq_len), dtype, sharding=rows_sh)
  optional = {f: (bt(jnp.float32) if f in fields else None)
              for f in ("behaviour_logp", "old_logp", "ref_logp")}
  return TrainBatch(input_ids=bt(jnp.int32), target_ids=bt(jnp.int32),
                    loss_mask=bt(jnp.float32), positions=bt(jnp.int32),
                    segment_ids=bt(jnp.int32), seq_ids=bt(jnp.int32),
                    seq_valid=jax.ShapeDtypeStruct((max_seqs,), jnp.float32, sharding=rep),
                    advantages=bt(jnp.float32), **optional)


@dataclasses.dataclass(frozen=True)
class Compiled:
  """A compiled train step and the abstract inputs it was compiled for."""
  compiled: jax.stages.Compiled
  state: object                  # the abstract TrainState (ShapeDtypeStructs with shardings)
  batch: TrainBatch              # the abstract batch
  loss_temp_bytes: int           # temporaries of the LM-head loss compiled alone (one micro-batch)
  seconds: float                 # lower + compile wall time
  frozen: object = None          # LoRA: the abstract frozen base (state.params are the adapters)


def _head_loss_temp(model_cfg: ModelConfig, cfg: LearnerConfig, loss_cfg, batch: TrainBatch,
                    mesh: Mesh, head) -> int:
  """Temporaries of the fused LM-head loss + its gradient alone, on one micro-batch's tokens."""
  from posttrain_jax.kernels import lm_head as kernels
  spec = get_loss(cfg.loss)
  if not (cfg.fused_loss and spec.separable and not spec.head):
    return 0
  rows, seq = batch.input_ids.shape
  fields = {f for f in ("behaviour_logp", "old_logp", "ref_logp") if getattr(batch, f) is not None}
  micro = abstract_batch(rows // cfg.micro_batches, seq, batch.num_seqs, fields, mesh)
  rows = micro.input_ids.shape[0]
  tok_sh = NamedSharding(mesh, P(("data", "fsdp")))
  h = jax.ShapeDtypeStruct((rows * seq, model_cfg.hidden_size), model_cfg.compute_jnp_dtype,
                           sharding=NamedSharding(mesh, P(("data", "fsdp"), None)))
  flat = lambda x: jax.ShapeDtypeStruct((rows * seq,), x.dtype, sharding=tok_sh)
  w, transposed = head

  def loss(h, w, y, mask, terms):
    out, _ = kernels.fused_logprob_loss(
        h, w.astype(h.dtype), y, functools.partial(spec.token_loss, cfg=loss_cfg), terms,
        temperature=cfg.temperature, mask=mask > 0, transposed=transposed, impl=cfg.logprob_impl)
    return out

  terms = jax.eval_shape(lambda b: spec.token_terms(b, loss_cfg), micro)
  terms = jax.tree.map(lambda x: flat(x) if x.ndim == 2 else x, terms)
  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  mem = grad.lower(h, w, flat(micro.target_ids), flat(micro.loss_mask), terms).compile()
  return int(mem.memory_analysis().temp_size_in_bytes)


def compile_train_step(model_cfg: ModelConfig, cfg: LearnerConfig, loss_cfg, mesh: Mesh, *,
                       rows: int, seq_len: int, max_seqs: int, fields: set[str]) -> Compiled:
  """Lowers and compiles `train_step` exactly as `Learner` jits it (donated state, the state's
  shardings out), on abstract inputs: no parameter or batch is ever allocated."""
  import time
  t0 = time.perf_counter()
  model = hf_io.abstract_model(model_cfg, mesh)
  graphdef, _ = nnx.split(model, nnx.Param)
  if cfg.lora.enabled:
    graphdef, _, _ = lora.attach(model, cfg.lora)
  state, frozen = abstract_train_state(model, cfg, mesh), abstract_frozen(model, cfg, mesh)
  batch = abstract_batch(rows, seq_len, max_seqs, fields, mesh)
  if rows % cfg.micro_batches or (rows // cfg.micro_batches) % (mesh.shape["data"]
                                                                 * mesh.shape["fsdp"]):
    raise AOTError(f"rl.learner.micro_batches={cfg.micro_batches} must split rl.batch.rows="
                   f"{rows} into micro-batches whose rows are a multiple of data × fsdp = "
                   f"{mesh.shape['data'] * mesh.shape['fsdp']}")
  spec = get_loss(cfg.loss)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  step = jax.jit(functools.partial(train_step, graphdef=graphdef, tx=make_optimizer(cfg.optimizer),
                                   spec=spec, loss_cfg=loss_cfg, cfg=cfg),
                 donate_argnums=0, out_shardings=(shardings, None))
  compiled = step.lower(state, batch, None, frozen).compile()
  params = state.params if frozen is None else frozen
  head = ((params["embed_tokens"], True) if model_cfg.tie_word_embeddings
          else (params["lm_head"]["kernel"], False))
  loss_temp = _head_loss_temp(model_cfg, cfg, loss_cfg, batch, mesh, head)
  return Compiled(compiled, state, batch, loss_temp, time.perf_counter() - t0, frozen)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Per-device bytes of each part and the capacity they are compared with."""
  parts: tuple[tuple[str, int, str], ...]   # (name, bytes, "measured" | "exact" | "estimate")
  total_bytes: int
  capacity_bytes: int
  compiler: dict                            # memory_analysis() fields, bytes

  @property
  def fits(self) -> bool:
    return self.total_bytes <= self.capacity_bytes

  def table(self) -> str:
    lines = [f"{'per device':<44}{'GiB':>10}  how", "-" * 64]
    for name, b, how in self.parts:
      lines.append(f"{name:<44}{b / GIB:>10.3f}  {how}")
    lines.append("-" * 64)
    lines.append(f"{'total':<44}{self.total_bytes / GIB:>10.3f}")
    lines.append(f"{'capacity':<44}{self.capacity_bytes / GIB:>10.3f}")
    return "\n".join(lines)

  def result_line(self) -> str:
    return (f"RESULT per_device_gb={self.total_bytes / GIB:.2f} "
            f"capacity_gb={self.capacity_bytes / GIB:.2f} fits={int(self.fits)}")

  def refusal(self) -> str:
    parts = ", ".join(f"{name} {b / GIB:.2f}" for name, b, _ in self.parts if b)
    return (f"does not fit: {self.total_bytes / GIB:.2f} GiB per device > capacity "
            f"{self.capacity_bytes / GIB:.2f} GiB ({parts}; GiB per device)")


def memory_report(c: Compiled, *, capacity_bytes: int, reference: bool,
                  micro_batches: int) -> MemoryReport:
  """Splits the compiled step's memory into its parts (see the module docstring)."""
  m = c.compiled.memory_analysis()
  compiler = {k: int(getattr(m, k)) for k in (
      "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
      "temp_size_in_bytes", "generated_code_size_in_bytes")}
  params, opt = tree_bytes(c.state.params), tree_bytes(c.state.opt_state)
  batch, frozen = tree_bytes(c.batch), tree_bytes(c.frozen) if c.frozen is not None else 0
  args = compiler["argument_size_in_bytes"]
  other_args = max(args - params - opt - batch - frozen, 0)
  out = max(compiler["output_size_in_bytes"] - compiler["alias_size_in_bytes"], 0)
  temp = compiler["temp_size_in_bytes"]
  grads = min(params * (2 if micro_batches > 1 else 1), temp)
  loss = min(c.loss_temp_bytes, temp - grads)
  parts = (
      ("params", params, "exact"),
      ("frozen base (LoRA; params are the adapters)", frozen, "exact"),
      ("optimizer state", opt, "exact"),
      ("batch", batch, "exact"),
      ("step, rng, padding (other arguments)", other_args, "measured"),
      ("outputs not aliased (metrics)", out, "measured"),
      ("gradients (in temporaries)", grads, "estimate"),
      ("activations, gathered weights (in temps)", temp - grads - loss, "estimate"),
      ("loss scratch, LM head (in temporaries)", loss, "estimate"),
      ("generated code", compiler["generated_code_size_in_bytes"], "measured"),
      ("reference params (rl.reference_kl)", params if reference else 0, "exact"),
  )
  total = sum(b for _, b, _ in parts)
  return MemoryReport(parts, total, int(capacity_bytes), compiler)



_NO_PATH = "<not read by the AOT check>"


def run_config_for_check(raw: dict):
  """The RunConfig of `raw`, validated with `model.path` / `tasks.path` filled by a marker where
  missing: the check reads neither (the architecture comes from `model.arch`)."""
  from posttrain_jax.run_config import run_config_from_dict
  raw = {**raw, "model": dict(raw.get("model") or {}), "tasks": dict(raw.get("tasks") or {})}
  if not raw["model"].get("path"):
    if not raw["model"].get("arch"):
      raise AOTError("the config names no model: set model.arch (a published architecture, "
                     "posttrain_jax/models/published.py) or model.path (a HF directory)")
    raw["model"]["path"] = _NO_PATH
  if raw["tasks"].get("source", "synthetic") != "synthetic" and not raw["tasks"].get("path"):
    raw["tasks"]["path"] = _NO_PATH
  return run_config_from_dict(raw)


def model_config_of(cfg) -> ModelConfig:
  """The architecture: `model.path`'s config.json when that directory exists, else `model.arch`."""
  import os
  from posttrain_jax.models import published
  m = cfg.model
  over = dict(param_dtype=m.param_dtype, compute_dtype=m.compute_dtype, remat=m.remat)
  if m.path and m.path != _NO_PATH and os.path.isdir(m.path):
    return hf_io.read_model_config(m.path, **over)
  if m.arch is None:
    raise AOTError(f"model.path={m.path!r} is no directory and model.arch is not set: the check "
                   "needs the architecture from one of them")
  return published.model_config(m.arch, **over)


def rollout_share(cfg) -> float:
  """Fraction of each learner GPU the rollout engine takes (an in-process vLLM's share; 0 for
  engines outside the learner's devices)."""
  return engine_spec(cfg.rl.engine).share_of_device(cfg.engine_config())


def check(cfg, mesh: Mesh, device_memory_bytes: int) -> tuple[MemoryReport, Compiled]:
  """Compiles `cfg`'s RL train step on `mesh` and reports its memory against the capacity
  (device memory less an in-process vLLM's share)."""
  learner = cfg.rl.learner
  loss_cfg = cfg.loss_config()
  needs = get_loss(learner.loss).needs(loss_cfg)
  reference = cfg.rl.reference_kl or "ref_logp" in needs
  fields = batch_fields(learner.loss, loss_cfg, reference=reference,
                        update_epochs=cfg.rl.update_epochs)
  b = cfg.rl.batch
  compiled = compile_train_step(model_config_of(cfg), learner, loss_cfg, mesh, rows=b.rows,
                                seq_len=b.seq_len, max_seqs=b.max_seqs, fields=fields)
  capacity = int(device_memory_bytes * (1.0 - rollout_share(cfg)))
  report = memory_report(compiled, capacity_bytes=capacity, reference=reference,
                         micro_batches=learner.micro_batches)
  return report, compiled


__all__ = ["DEVICE_MEMORY_GIB", "GIB", "AOTError", "Compiled", "MemoryReport", "abstract_batch",
           "batch_fields", "check", "compile_train_step", "device_kind", "memory_report",
           "model_config_of", "rollout_share", "run_config_for_check", "tree_bytes"]
