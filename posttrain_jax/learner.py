"""The learner: a jitted, sharded `train_step(state, batch) -> (state, metrics)`.

    hidden = model(input_ids, positions, segment_ids, prefix_ids)  [B, T, D]
    logp_t = log softmax((hidden_t @ W_head) / tau)[target_t]       fused kernel, no [B, T, V]
    loss, metrics = LOSSES[cfg.loss].fn(logp, batch, loss_cfg)
    grads = sum_k d(loss_k * count_k) / sum_k count_k               exact over micro-batches

Every loss returns its within-batch normaliser `count` beside the value (losses/base.py), so
splitting the batch into micro-batches and accumulating `loss_k * count_k` gives the same
gradient as the full batch (not a mean of means). For separable losses the fused-loss kernel
computes dh/dW during its forward pass (6·N·D·V FLOPs for the head instead of 8).

Parameters are a plain nested dict (`nnx.to_pure_dict`) merged back into the model inside the
step, so optax and orbax see ordinary pytrees. The reference model and the "old" policy's
log-probs (multi-epoch PPO) come from `logprobs()` with other params, computed before the step.

LoRA (`LearnerConfig.lora.rank` > 0, models/lora.py): the TrainState's params are the adapters
only (so are the optimizer state and the checkpoints); the base parameters are `frozen`, an
argument of the step the gradient is not taken of, and the forward pass sees
`lora.join(frozen, adapters)`. `Learner.params` is always the whole dict the graph takes; the
reference is the base with adapters off (`adapters_off`), no second copy of the weights.

Per tenant (`lora.tenants`, tenants.py): the TrainState stacks one adapter state per tenant;
`select(i)` picks the tenant that `params`, `step`, `logprobs` and `model` act on (the rollout
source picks it with the sessions it collects), and a step trains that tenant's row alone.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from posttrain_jax.kernels import lm_head as kernels
from posttrain_jax.losses import get_loss
from posttrain_jax.losses.base import HeadInputs, LossSpec
from posttrain_jax.models import lora
from posttrain_jax.models.decoder import Decoder
from posttrain_jax import tenants as tn
from posttrain_jax.multihost import put_global
from posttrain_jax.types import TrainBatch, TrainState


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with linear warmup then cosine (or constant) learning rate, global-norm clipping."""
  learning_rate: float = 1e-5     # peak learning rate
  warmup_steps: int = 0           # linear warmup from 0 to the peak
  decay_steps: int = 0            # cosine decay length after warmup; 0 = constant
  end_lr_ratio: float = 0.1       # final lr / peak lr of the cosine decay
  weight_decay: float = 0.0       # decoupled weight decay (matrices only, not norms/biases)
  b1: float = 0.9                 # Adam first-moment decay
  b2: float = 0.999               # Adam second-moment decay
  eps: float = 1e-8               # Adam epsilon
  grad_clip_norm: float = 1.0     # clip the global gradient norm (0 = off)


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """How the learner turns a TrainBatch into an update."""
  loss: str = "grpo"              # a name in the loss registry (posttrain_jax.losses)
  micro_batches: int = 1          # rows split into this many interleaved micro-batches (exact accumulation)
  temperature: float = 1.0        # log-probs are of softmax(logits / temperature), like the sampler
  logprob_impl: str = "auto"      # LM-head kernel: auto | reference | chunked | pallas_gpu | pallas_tpu
  fused_loss: bool = True         # separable losses: gradients in the kernel's forward pass
  optimizer: OptimizerConfig = OptimizerConfig()
  lora: lora.LoRAConfig = lora.LoRAConfig()  # low-rank adapters, base frozen (rank 0 = off)
  seed: int = 0                   # the TrainState rng (and the adapters' initialisation)


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
  warm = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps) if cfg.warmup_steps else None
  if cfg.decay_steps:
    decay = optax.cosine_decay_schedule(cfg.learning_rate, cfg.decay_steps, cfg.end_lr_ratio)
  else:
    decay = optax.constant_schedule(cfg.learning_rate)
  if warm is None:
    return decay
  return optax.join_schedules([warm, decay], [cfg.warmup_steps])


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  parts = [optax.clip_by_global_norm(cfg.grad_clip_norm)] if cfg.grad_clip_norm else []
  parts.append(optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay, mask=decay_mask))
  return optax.chain(*parts)


def _hidden_and_head(graphdef, params, batch: TrainBatch, rng=None):
  model: Decoder = nnx.merge(graphdef, params)
  hidden, _ = model(batch.input_ids, batch.positions, batch.segment_ids,
                    prefix_ids_bt=batch.prefix_ids, dropout_rng=rng)
  w, transposed = model.head()
  return hidden.reshape(-1, hidden.shape[-1]), w, transposed


def token_logprobs(graphdef, params, batch: TrainBatch, *, temperature: float = 1.0,
                   impl: str = "auto", return_entropy: bool = False, rng=None):
  """log pi(target_t) per position [B, T] (0 where loss_mask = 0); optionally the entropy.
  `rng`: the LoRA adapters' dropout key (training); None = no dropout."""
  h, w, transposed = _hidden_and_head(graphdef, params, batch, rng)
  out = kernels.token_logprobs(h, w, batch.target_ids.reshape(-1), temperature=temperature,
                               mask=batch.loss_mask.reshape(-1) > 0, transposed=transposed,
                               impl=impl, return_entropy=return_entropy)
  shape = batch.target_ids.shape
  if return_entropy:
    return out[0].reshape(shape), out[2].reshape(shape)
  return out[0].reshape(shape)


def hidden_states(graphdef, params, batch: TrainBatch) -> jax.Array:
  """The final hidden states [B, T, D] (the LM head's input)."""
  h, _, _ = _hidden_and_head(graphdef, params, batch)
  return h.reshape(*batch.target_ids.shape, h.shape[-1])


def objective(params, batch: TrainBatch, teacher_w=None, *, graphdef, spec: LossSpec, loss_cfg,
              cfg: LearnerConfig, frozen=None, rng=None):
  """(loss * count, metrics): the quantity whose gradients add up across micro-batches.
  `teacher_w`: a head loss's teacher head (HeadInputs.teacher_w), or None. `frozen`: LoRA's base
  parameters (`params` are then the adapters), or None; `rng`: the adapters' dropout key."""
  params = lora.join(frozen, params)
  if spec.head:   # the loss reads the distribution itself (losses/base.py, head losses)
    h, w, transposed = _hidden_and_head(graphdef, params, batch, rng)
    loss, metrics = spec.fn(HeadInputs(h, w, transposed, cfg.temperature, teacher_w), batch,
                            loss_cfg)
  elif cfg.fused_loss and spec.separable:
    h, w, transposed = _hidden_and_head(graphdef, params, batch, rng)
    terms = spec.token_terms(batch, loss_cfg)
    flat = jax.tree.map(lambda x: x.reshape(-1) if jnp.ndim(x) == 2 else x, terms)
    loss, logp = kernels.fused_logprob_loss(
        h, w, batch.target_ids.reshape(-1), functools.partial(spec.token_loss, cfg=loss_cfg),
        flat, temperature=cfg.temperature, mask=batch.loss_mask.reshape(-1) > 0,
        transposed=transposed, impl=cfg.logprob_impl)
    _, metrics = spec.fn(logp.reshape(batch.target_ids.shape), batch, loss_cfg)
  else:
    logp = token_logprobs(graphdef, params, batch, temperature=cfg.temperature,
                          impl=cfg.logprob_impl, rng=rng)
    loss, metrics = spec.fn(logp, batch, loss_cfg)
  return loss * metrics["loss"][1], metrics


def _present_sequences(batch: TrainBatch) -> jax.Array:
  """seq_valid restricted to sequences with at least one token in this (micro-)batch."""
  present = jax.ops.segment_sum((batch.segment_ids > 0).reshape(-1).astype(jnp.float32),
                                batch.seq_ids.reshape(-1), num_segments=batch.num_seqs)
  return batch.seq_valid * (present > 0)


def split_micro_batches(batch: TrainBatch, m: int) -> TrainBatch:
  """[B, ...] fields -> [m, B/m, ...], interleaved: row r of micro-batch k is row r·m + k.
  seq_valid is recomputed per micro-batch, stacked [m, S].

  Why interleaved: rows are sharded over (data, fsdp) in contiguous blocks, so contiguous
  micro-batches would each sit on 1/m of the devices (XLA all-gathers them onto every
  device). Interleaved, micro-batch k has B/(m·shards) rows on every shard whenever
  m·shards divides B, and each accumulation step runs on every device with no data moved.
  Exactness is unaffected: a sequence lives in one row and the summed losses ignore order.
  """
  rows = batch.input_ids.shape[0]
  if rows % m:
    raise ValueError(f"LearnerConfig.micro_batches={m} does not divide the batch's {rows} rows")

  def split(name, x):
    if x is None or name == "seq_valid":
      return x
    return x.reshape(rows // m, m, *x.shape[1:]).swapaxes(0, 1)

  fields = {f.name: split(f.name, getattr(batch, f.name)) for f in dataclasses.fields(batch)}
  stacked = TrainBatch(**fields)
  valid = jax.vmap(lambda b: _present_sequences(
      dataclasses.replace(b, seq_valid=batch.seq_valid)))(
          dataclasses.replace(stacked, seq_valid=jnp.broadcast_to(
              batch.seq_valid, (m, batch.num_seqs))))
  return dataclasses.replace(stacked, seq_valid=valid)


def gradients(params, batch: TrainBatch, teacher_w=None, *, graphdef, spec: LossSpec, loss_cfg,
              cfg: LearnerConfig, frozen=None, rng=None) -> tuple[Any, dict]:
  """Gradient of the batch loss (normalised over all micro-batches) w.r.t. `params` (with
  `frozen`: LoRA's adapters, the base held fixed) and summed metric pairs. `rng`: the adapters'
  dropout key (micro-batch k uses fold_in(rng, k)), or None."""
  grad_fn = jax.value_and_grad(
      lambda p, b, r: objective(p, b, teacher_w, graphdef=graphdef, spec=spec, loss_cfg=loss_cfg,
                                cfg=cfg, frozen=frozen, rng=r), has_aux=True)
  if cfg.micro_batches == 1:
    (_, metrics), grads = grad_fn(params, batch, rng)
  else:
    micro = split_micro_batches(batch, cfg.micro_batches)
    first = jax.tree.map(lambda x: x[0], micro)
    _, metric_shape = jax.eval_shape(lambda p, b: grad_fn(p, b, rng)[0], params, first)
    keys = (None if rng is None else
            jax.vmap(lambda k: jax.random.fold_in(rng, k))(jnp.arange(cfg.micro_batches)))

    def body(carry, xs):
      g_acc, m_acc = carry
      mb, key = xs
      (_, metrics), g = grad_fn(params, mb, key)
      return (jax.tree.map(jnp.add, g_acc, g), jax.tree.map(jnp.add, m_acc, metrics)), None

    zeros = (jax.tree.map(jnp.zeros_like, params),
             jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shape))
    (grads, metrics), _ = jax.lax.scan(body, zeros, (micro, keys))
  count = metrics["loss"][1]
  grads = jax.tree.map(lambda g: jnp.where(count > 0, g / jnp.maximum(count, 1e-12), 0.0), grads)
  return grads, metrics


def train_step(state: TrainState, batch: TrainBatch, teacher_w=None, frozen=None, *, graphdef,
               tx: optax.GradientTransformation, spec: LossSpec, loss_cfg,
               cfg: LearnerConfig) -> tuple[TrainState, dict]:
  """One optimizer update from `batch` (pure; `Learner` jits it with donated state).
  `frozen`: LoRA's base parameters (state.params are the adapters), else None."""
  rng = (jax.random.split(state.rng)[0] if cfg.lora.enabled and cfg.lora.dropout > 0
         else None)   # distinct from the next state's rng, fold_in(rng, step)
  grads, metrics = gradients(state.params, batch, teacher_w, graphdef=graphdef, spec=spec,
                             loss_cfg=loss_cfg, cfg=cfg, frozen=frozen, rng=rng)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  out = {k: s / jnp.maximum(c, 1e-12) for k, (s, c) in metrics.items()}
  out["grad_norm"] = optax.global_norm(grads)
  out["tokens"] = jnp.sum(batch.loss_mask)
  new_state = TrainState(params=params, opt_state=opt_state, step=state.step + 1,
                         rng=jax.random.fold_in(state.rng, state.step))
  return new_state, out


def _replicated(mesh: Optional[Mesh]):
  return (NamedSharding(mesh, P()) if mesh is not None
          else jax.sharding.SingleDeviceSharding(jax.devices()[0]))


def optimizer_shardings(tx: optax.GradientTransformation, params, mesh: Optional[Mesh]):
  """The shardings of `tx.init(params)`: every leaf shaped like a parameter (Adam's mu and nu)
  sharded like that parameter, the rest (step counts) replicated. Left to the compiler,
  `jit(tx.init)` replicates the zeros it makes, and every device holds the whole optimizer
  state (8 bytes per parameter for AdamW in float32) however the parameters are sharded."""
  rep = _replicated(mesh)
  shardings = jax.tree.map(lambda p: p.sharding if isinstance(getattr(p, "sharding", None),
                                                              NamedSharding) else rep, params)
  return optax.tree_map_params(tx, lambda _, sh: sh, jax.eval_shape(tx.init, params), shardings,
                               transform_non_params=lambda v: jax.tree.map(lambda _: rep, v))


def _abstract_params(model: Decoder, mesh: Optional[Mesh]) -> dict:
  """`model`'s parameters as ShapeDtypeStructs with their shardings (a pure dict)."""
  from posttrain_jax.models.hf_io import param_shardings
  _, params = nnx.split(model, nnx.Param)
  nested: dict = {}
  for path, sharding in param_shardings(model, mesh).items():
    d = nested
    for k in path[:-1]:
      d = d.setdefault(k, {})
    d[path[-1]] = sharding
  return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                      nnx.to_pure_dict(params), nested)


def abstract_frozen(model: Decoder, cfg: LearnerConfig, mesh: Optional[Mesh] = None):
  """The frozen base a LoRA `Learner(model, cfg, mesh=mesh)` holds, as ShapeDtypeStructs with
  their shardings (in LoRAConfig.base_dtype, as lora.cast_base makes it); None without LoRA."""
  if not cfg.lora.enabled:
    return None
  return lora.cast_base(_abstract_params(model, mesh), cfg.lora.base_dtype)


def abstract_train_state(model: Decoder, cfg: LearnerConfig,
                         mesh: Optional[Mesh] = None) -> TrainState:
  """The TrainState a `Learner(model, cfg, mesh=mesh)` would hold, as ShapeDtypeStructs with
  their shardings; `model` may be abstract (`hf_io.abstract_model`). Nothing is allocated: this
  is the restore target of a checkpoint. With LoRA the params are the adapters alone; per
  tenant, every leaf has the tenant axis in front (tenants.py)."""
  if cfg.lora.enabled:
    _, adapters, _ = lora.attach(model, cfg.lora)
    params = lora.abstract_adapters(adapters, mesh, model.rules)
  else:
    params = _abstract_params(model, mesh)
  rep = _replicated(mesh)
  tx = make_optimizer(cfg.optimizer)
  opt_state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                           jax.eval_shape(tx.init, params), optimizer_shardings(tx, params, mesh))
  rng = jax.eval_shape(lambda: jax.random.key(cfg.seed))
  state = TrainState(params=params, opt_state=opt_state,
                     step=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
                     rng=jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=rep))
  return tn.stack_abstract(state, len(cfg.lora.tenants)) if cfg.lora.per_tenant else state


class Learner:
  """Holds the jitted step and shardings; `step(batch)` returns host metrics.

  With `state` (e.g. restored from a checkpoint into `abstract_train_state`), `model` only
  provides the graph (it may be abstract) and no initial state is built. With LoRA, `model`
  provides the frozen base too (so it must hold weights), and `state` the adapters.
  """

  def __init__(self, model: Decoder, cfg: LearnerConfig, loss_cfg=None,
               mesh: Optional[Mesh] = None, state: Optional[TrainState] = None):
    self.cfg = cfg
    self.spec = get_loss(cfg.loss)
    self.loss_cfg = loss_cfg if loss_cfg is not None else self.spec.config_cls()
    if not isinstance(self.loss_cfg, self.spec.config_cls):
      raise TypeError(f"loss {cfg.loss!r} takes a {self.spec.config_cls.__name__}, got "
                      f"{type(self.loss_cfg).__name__}")
    self.mesh = mesh
    self.frozen = None   # LoRA: the base parameters (never updated); None: all of them train
    if cfg.lora.enabled:
      self.graphdef, params, base = lora.attach(model, cfg.lora)
      if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(base)):
        raise ValueError("a LoRA learner (LearnerConfig.lora.rank > 0) needs the base weights: "
                         "pass a loaded model (hf_io.load_hf_model), not an abstract one")
      self.frozen = lora.cast_base(base, cfg.lora.base_dtype)
      del base
      if state is None:
        params = lora.init_adapters(params, cfg.seed, mesh, model.rules)
    else:
      self.graphdef, params = nnx.split(model, nnx.Param)
      params = nnx.to_pure_dict(params)
    self.tx = make_optimizer(cfg.optimizer)
    self.schedule = learning_rate_schedule(cfg.optimizer)
    self.tenants, self.tenant = tuple(cfg.lora.tenants), 0   # per tenant: the row acted on
    if state is None:
      opt_state = jax.jit(self.tx.init,
                          out_shardings=optimizer_shardings(self.tx, params, mesh))(params)
      state = TrainState(params=params, opt_state=opt_state,
                         step=jnp.zeros((), jnp.int32), rng=jax.random.key(cfg.seed))
      if self.tenants:
        state = put_global(tn.stack(state, len(self.tenants)),
                           jax.tree.map(lambda x: tn.stacked_sharding(x.sharding), state))
    del params
    # Every leaf committed to an explicit sharding (scalars replicated), so the state the step
    # returns has the same signature as the one it took: one compilation, not two.
    replicated = _replicated(mesh)
    self._state_sharding = jax.tree.map(
        lambda x: x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding)
        else replicated, state)
    self.state = put_global(state, self._state_sharding)
    self._step = self._jit_step()
    self._logprobs = jax.jit(functools.partial(token_logprobs, self.graphdef,
                                               temperature=cfg.temperature, impl=cfg.logprob_impl))
    self._hidden = jax.jit(functools.partial(hidden_states, self.graphdef))

  def _jit_step(self):
    step = functools.partial(train_step, graphdef=self.graphdef, tx=self.tx, spec=self.spec,
                             loss_cfg=self.loss_cfg, cfg=self.cfg)
    if self.tenants:
      step = tn.tenant_step(step)
    return jax.jit(step, donate_argnums=0, out_shardings=(self._state_sharding, None))

  def select(self, tenant: str) -> None:
    """Per tenant: act on `tenant`'s adapters from now on (params, step, logprobs, model)."""
    self.tenant = tn.tenant_index(self.tenants, tenant)

  def _adapters(self):
    """The adapters acted on: the TrainState's params (per tenant: the selected row)."""
    return tn.take(self.state.params, self.tenant) if self.tenants else self.state.params

  def set_loss_config(self, loss_cfg) -> None:
    """Trains with `loss_cfg` (the same loss) from the next step on: e.g. the off-policy
    correction an RL run adds when it turns asynchronous (rl.mode="auto"); the state is kept."""
    if not isinstance(loss_cfg, self.spec.config_cls):
      raise TypeError(f"loss {self.cfg.loss!r} takes a {self.spec.config_cls.__name__}, got "
                      f"{type(loss_cfg).__name__}")
    if loss_cfg != self.loss_cfg:
      self.loss_cfg = loss_cfg
      self._step = self._jit_step()

  @property
  def params(self):
    """The whole parameter dict the graph takes (with LoRA: the base joined with the adapters,
    no copy)."""
    return lora.join(self.frozen, self._adapters())

  def adapters_off(self):
    """The parameters of the base model alone, for the reference policy and frozen teachers:
    with LoRA the base with its adapters at zero (no copy of the base); without, a copy of the
    current parameters (the learner donates its own buffers at every step)."""
    if self.frozen is None:
      return jax.tree.map(jnp.copy, self.state.params)
    return lora.join(self.frozen, lora.disabled(self._adapters()))

  @property
  def row_multiple(self) -> int:
    """This process's batch rows must be a multiple of this: its row shards (data × fsdp /
    processes) × micro-batches."""
    shards = 1 if self.mesh is None else self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    if shards % jax.process_count():
      raise ValueError(f"the mesh's {shards} row shards (data x fsdp) must be a multiple of the "
                       f"{jax.process_count()} processes: each process feeds whole row shards")
    return shards // jax.process_count() * self.cfg.micro_batches

  @property
  def step_count(self) -> int:
    """Updates applied (per tenant: to the selected tenant, its policy version)."""
    return int(self.state.step[self.tenant] if self.tenants else self.state.step)

  def model(self) -> Decoder:
    """The current model (shares the learner's arrays; do not keep across steps). With LoRA it
    carries the adapters; hf_io.save_hf_model exports it merged, peft_io.save_peft_adapter its
    adapters."""
    return nnx.merge(self.graphdef, self.params)

  def shared_model(self) -> Decoder:
    """What `final_model/` holds: the current model; per tenant, the shared base (adapters off;
    each tenant's adapters are exported on their own)."""
    return nnx.merge(self.graphdef, self.adapters_off()) if self.tenants else self.model()

  def put_batch(self, batch: TrainBatch) -> TrainBatch:
    """Moves a host batch onto the mesh: rows split over the data axes.

    Several processes: `batch` is this process's part of the global batch (its rows, its
    sequences); the global batch is every process's rows in process order, its sequence
    indices offset by process (seq_ids + process_index · S) and `seq_valid` the processes'
    [S] vectors end to end. Every process must pass the same shape (fit_shape's `agree`)."""
    if self.mesh is None:
      return jax.tree.map(jnp.asarray, batch)
    rows = NamedSharding(self.mesh, P(("data", "fsdp")))
    rep = NamedSharding(self.mesh, P())
    if jax.process_count() == 1:
      return jax.tree.map(lambda x: jax.device_put(x, rows if np.ndim(x) >= 2 else rep), batch)
    from jax.experimental import multihost_utils
    s = int(np.shape(batch.seq_valid)[0])
    valid = np.asarray(multihost_utils.process_allgather(np.asarray(batch.seq_valid))).reshape(-1)
    batch = dataclasses.replace(batch, seq_ids=np.asarray(batch.seq_ids) + jax.process_index() * s,
                                seq_valid=valid)
    return jax.tree.map(
        lambda x: (jax.make_array_from_process_local_data(rows, np.asarray(x))
                   if np.ndim(x) >= 2 else jax.device_put(x, rep)), batch)

  def local_rows(self, x: jax.Array) -> np.ndarray:
    """This process's rows of a row-sharded [B, ...] result, on the host (all of them with one
    process): the rows of the batch this process put in."""
    if jax.process_count() == 1 or self.mesh is None:
      return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.global_array_to_host_local_array(
        x, self.mesh, P(("data", "fsdp"))))

  def logprobs(self, batch: TrainBatch, params=None) -> np.ndarray:
    """Per-token log-probs [B, T] of `batch.target_ids` under `params` (default: current), on
    the host (several processes: this process's rows)."""
    out = self._logprobs(self.params if params is None else params, self.put_batch(batch))
    return self.local_rows(out)

  def hidden(self, batch: TrainBatch, params=None) -> np.ndarray:
    """The final hidden states [B, T, D] of `batch` under `params` (default: current), on the
    host (several processes: this process's rows)."""
    return self.local_rows(self._hidden(self.params if params is None else params,
                                        self.put_batch(batch)))

  def step(self, batch: TrainBatch, teacher_w=None) -> dict[str, float]:
    """One update; `teacher_w`: a head loss's teacher head (an EMA teacher's), else None."""
    extra = (jnp.int32(self.tenant),) if self.tenants else ()
    self.state, metrics = self._step(self.state, self.put_batch(batch), teacher_w, self.frozen,
                                     *extra)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    metrics["lr"] = float(self.schedule(self.step_count - 1))
    return metrics

  def restore(self, state: TrainState) -> None:
    self.state = put_global(state, self._state_sharding)
