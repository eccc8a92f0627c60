"""LoRA: low-rank adapters on named projections, the base frozen (Hu et al. 2021, arXiv 2106.09685).

    y = x W (+ b) + s · dropout(x) A B,      A [in, r], B [r, out], s = alpha / r

A starts as PEFT's does (kaiming-uniform with a = sqrt(5) on its [r, in] weight, i.e.
U(-1/sqrt(in), 1/sqrt(in))) and B at zero, so a fresh adapter leaves the model's outputs as they
were: exactly op by op (a jitted forward may differ in the last bit: XLA fuses the adapted graph
differently). The adapters live in the projections themselves (decoder.Linear's `lora_a` /
`lora_b`, variable type `LoRAParam`, logical axes (in, "lora_rank") and ("lora_rank", out)) but in
a parameter tree of their own: `attach` returns the adapted graph, the adapters' shapes and the
base parameters, `join` puts the two trees together for a forward pass. The learner
differentiates and optimises the adapters only; the base is an argument of the step that never
changes, optionally stored in bfloat16 or int8 (`cast_base`): int8 holds every decoder-block
kernel as quant.Int8Kernel (q int8, a float32 scale per output channel, W ≈ q · scale),
dequantised inside each forward pass (decoder.Linear), so the step, the reference and the
embedded sampler all read the int8 arrays.

Adapters off is A = B = 0 (`disabled`): the reference policy and frozen teachers are the base
model with no second copy of its weights. `merged` folds W + s·A·B into a plain model (the HF
export does so by itself: hf_io.save_hf_model; an int8 base is dequantised there, the merged
kernels in float32); peft_io.py writes the adapters in PEFT's format.

Simplified: adapters only on projections inside the decoder blocks (the LM head enters the
fused log-prob kernel as a weight, so an adapter there would be skipped); no rsLoRA / DoRA; the
int8 base quantises the block projections only (quant.py: weights only, no QLoRA NF4 / double
quantisation).
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Iterator, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from posttrain_jax import sharding as shd
from posttrain_jax.models import quant
from posttrain_jax.models.decoder import Decoder, Linear
from posttrain_jax.tenants import check_tenants

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BASE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """Low-rank adapters on the learner's model (rank 0 = off: every parameter trains).

  The adapters and their optimizer state are float32 whatever `base_dtype` is; base_dtype="int8"
  quantises only the decoder blocks' projection kernels (q/k/v/o/gate/up/down), while the
  embeddings, norms, biases and LM head stay as loaded (float32 for a float32 model)."""
  rank: int = 0                   # r; 0 = no adapters (full fine-tuning)
  alpha: float = 16.0             # scale s = alpha / r (PEFT's lora_alpha)
  dropout: float = 0.0            # dropout on an adapter's input, in training steps only
  target_modules: tuple[str, ...] = TARGETS  # fnmatch patterns on a projection's name ("q_proj")
                                  # or path ("layers.0.mlp.up_proj"); HF names, attention + MLP
  base_dtype: str = "float32"     # storage dtype of the frozen base: float32 | bfloat16 |
                                  # int8 (block projection kernels only: int8 + a float32
                                  # scale per output channel, models/quant.py)
  tenants: tuple[str, ...] = ()   # one adapter per tenant named (posttrain_jax/tenants.py):
                                  # each trains on its own sessions only and serves its own
                                  # calls (rl.mode traces / online); () = one adapter

  def __post_init__(self):
    if self.rank < 0:
      raise ValueError(f"LoRAConfig.rank must be ≥ 0 (0 = no adapters), got {self.rank}")
    if not self.alpha > 0:
      raise ValueError(f"LoRAConfig.alpha must be > 0, got {self.alpha}")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"LoRAConfig.dropout must be in [0, 1), got {self.dropout}")
    if self.base_dtype not in _BASE_DTYPES:
      raise ValueError(f"LoRAConfig.base_dtype is {self.base_dtype!r}; valid: "
                       f"{sorted(_BASE_DTYPES)}")
    if self.tenants and not self.rank:
      raise ValueError(f"LoRAConfig.tenants={list(self.tenants)} needs adapters: set rank > 0")
    why = check_tenants(tuple(self.tenants))
    if why:
      raise ValueError(why)
    if self.rank and not self.target_modules:
      raise ValueError("LoRAConfig.target_modules is empty: no projection would get an adapter")

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def per_tenant(self) -> bool:
    """One adapter per tenant (`tenants` named)."""
    return bool(self.tenants)

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


class LoRAParam(nnx.Param):
  """An adapter matrix: trained, while the base (plain nnx.Param) stays frozen."""


def projections(model: Decoder) -> Iterator[tuple[tuple, Linear]]:
  """(path, Linear) of every projection in the decoder blocks, e.g. (layers, 0, mlp, up_proj)."""
  for path, node in nnx.iter_graph(model):
    if isinstance(node, Linear) and path and path[0] == "layers":
      yield tuple(path), node


def _targeted(path: tuple, patterns: tuple[str, ...]) -> bool:
  dotted = ".".join(str(p) for p in path)
  return any(fnmatch.fnmatchcase(str(path[-1]), p) or fnmatch.fnmatchcase(dotted, p)
             for p in patterns)


def attach(model: Decoder, cfg: LoRAConfig) -> tuple[nnx.GraphDef, nnx.State, dict]:
  """(graphdef of `model` with adapters on the targeted projections, the adapters' abstract
  state (shapes, dtype float32, logical axes), the base parameters as a pure dict: `model`'s own
  arrays, not copied). `model` is not changed; it may be abstract (hf_io.abstract_model)."""
  graphdef, base = nnx.split(model, nnx.Param)
  copy = nnx.eval_shape(lambda s: nnx.merge(graphdef, s), base)   # a copy, no arrays
  hit = 0
  for path, lin in projections(copy):
    if not _targeted(path, cfg.target_modules):
      continue
    (din, dout), (ain, aout) = lin.kernel.shape, lin.kernel.get_metadata()["axes"]
    lin.lora_a = LoRAParam(jax.ShapeDtypeStruct((din, cfg.rank), jnp.float32),
                           axes=(ain, "lora_rank"))
    lin.lora_b = LoRAParam(jax.ShapeDtypeStruct((cfg.rank, dout), jnp.float32),
                           axes=("lora_rank", aout))
    lin.lora_scale, lin.lora_dropout = cfg.scale, cfg.dropout
    hit += 1
  if not hit:
    names = sorted({str(p[-1]) for p, _ in projections(copy)})
    raise ValueError(f"LoRAConfig.target_modules={list(cfg.target_modules)} matches no projection "
                     f"of the model; its projections are {names} (or paths like "
                     "'layers.0.self_attn.q_proj')")
  lora_graphdef, adapters, _ = nnx.split(copy, LoRAParam, nnx.Param)
  return lora_graphdef, adapters, nnx.to_pure_dict(base)


def _sharding(var, mesh: Optional[Mesh], rules):
  if mesh is None:
    return SingleDeviceSharding(jax.devices()[0])
  return NamedSharding(mesh, shd.logical_to_spec(var.get_metadata()["axes"], rules, mesh,
                                                 var.shape))


def abstract_adapters(adapters: nnx.State, mesh: Optional[Mesh], rules=shd.DEFAULT_RULES) -> dict:
  """The adapters as a pure dict of ShapeDtypeStructs with their shardings (logical axes)."""
  shardings = nnx.to_pure_dict(jax.tree.map(lambda v: _sharding(v, mesh, rules), adapters,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable)))
  return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                      nnx.to_pure_dict(adapters), shardings)


def init_adapters(adapters: nnx.State, seed: int, mesh: Optional[Mesh] = None,
                  rules=shd.DEFAULT_RULES) -> dict:
  """Fresh adapters (A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0), each made in its sharding."""
  target = abstract_adapters(adapters, mesh, rules)

  def make(key):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    out = []
    for i, (path, a) in enumerate(leaves):
      if path[-1].key == "lora_a":
        bound = a.shape[0] ** -0.5
        out.append(jax.random.uniform(jax.random.fold_in(key, i), a.shape, a.dtype, -bound, bound))
      else:
        out.append(jnp.zeros(a.shape, a.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)

  shardings = jax.tree.map(lambda a: a.sharding, target)
  return jax.jit(make, out_shardings=shardings)(jax.random.key(seed))


def _at(tree: dict, path: tuple):
  for k in path:
    tree = tree[k.key]
  return tree


def _is_block_kernel(path, x) -> bool:
  """A decoder-block projection's [in, out] kernel (layers.i.….kernel), what int8 quantises."""
  keys = [getattr(k, "key", None) for k in path]
  return keys[0] == "layers" and keys[-1] == "kernel" and len(x.shape) == 2


def cast_base(base: dict, dtype: str) -> dict:
  """The base parameters in `dtype` (LoRAConfig.base_dtype), each kept in its sharding; leaves
  already in it are the same arrays (no copy). "int8": each block kernel becomes a
  quant.Int8Kernel (its scale sharded like the kernel's output axis), every other leaf is the
  same array. `base` may be abstract (ShapeDtypeStructs with shardings): the result is too."""
  abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(base))
  if dtype == "int8":
    paths = [p for p, x in jax.tree_util.tree_leaves_with_path(base) if _is_block_kernel(p, x)]
    kernels = [_at(base, p) for p in paths]
    convert = jax.jit(lambda ws: [quant.quantize(w) for w in ws],
                      out_shardings=[quant.shardings(w.sharding) for w in kernels])
    done = dict(zip(paths, jax.eval_shape(convert, kernels) if abstract else convert(kernels)))
    return jax.tree_util.tree_map_with_path(lambda p, x: done.get(p, x), base)
  dt = _BASE_DTYPES[dtype]
  if all(x.dtype == dt for x in jax.tree.leaves(base)):
    return base
  shardings = jax.tree.map(lambda x: x.sharding, base)
  convert = jax.jit(lambda t: jax.tree.map(lambda x: x.astype(dt), t), out_shardings=shardings)
  return jax.eval_shape(convert, base) if abstract else convert(base)


def join(base: Optional[dict], adapters: dict) -> dict:
  """The model's whole parameter dict: `base` with the adapter leaves added beside each kernel
  (no array is copied). `base` None: `adapters` is already the whole dict (no LoRA)."""
  if base is None:
    return adapters
  out = dict(base)
  for k, v in adapters.items():
    out[k] = join(base[k], v) if isinstance(v, dict) and k in base else v
  return out


def disabled(adapters: dict) -> dict:
  """Adapters that are off (A = B = 0): with the base, exactly the base model."""
  return jax.tree.map(jnp.zeros_like, adapters)


def adapted(model: Decoder) -> Iterator[tuple[tuple, Linear]]:
  """(path, Linear) of the projections of `model` that carry an adapter."""
  return ((path, lin) for path, lin in projections(model) if lin.lora_a is not None)


def has_adapters(model: Decoder) -> bool:
  return any(True for _ in adapted(model))


@jax.jit
def _merge_kernel(w, a, b, scale):
  """W + s·A·B (no adapter: A, B None) in W's dtype; an int8 W dequantised, the result float32."""
  if isinstance(w, quant.Int8Kernel):
    w32, dtype = quant.dequantize(w), jnp.float32
  else:
    w32, dtype = w.astype(jnp.float32), w.dtype
  if a is not None:
    w32 = w32 + scale * jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")
  return w32.astype(dtype)


def merged(model: Decoder) -> Decoder:
  """A plain model (no adapters) computing what `model` computes without dropout: each adapted
  kernel is W + s·A·B, in W's dtype (rounded to it, as PEFT's merge_and_unload does on a
  bfloat16 base); an int8 kernel (LoRAConfig.base_dtype) is dequantised, adapted or not, into
  float32; every other parameter is `model`'s own array. A model with neither adapters nor int8
  kernels is returned as it is."""
  quantised = lambda lin: isinstance(lin.kernel.get_value(), quant.Int8Kernel)
  if not any(lin.lora_a is not None or quantised(lin) for _, lin in projections(model)):
    return model
  _, params = nnx.split(model, nnx.Param)   # LoRAParam is an nnx.Param: adapters included
  params = nnx.to_pure_dict(params)
  plain = nnx.eval_shape(lambda: type(model)(model.cfg, nnx.Rngs(0), mesh=model.mesh,
                                             rules=model.rules))
  for path, lin in projections(model):
    if lin.lora_a is None and not quantised(lin):
      continue
    node = params
    for k in path:
      node = node[k]
    node["kernel"] = _merge_kernel(node["kernel"], node.pop("lora_a", None),
                                   node.pop("lora_b", None), lin.lora_scale)
  graphdef, state = nnx.split(plain, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


__all__ = ["LoRAConfig", "LoRAParam", "TARGETS", "attach", "abstract_adapters", "init_adapters",
           "cast_base", "join", "disabled", "merged", "has_adapters", "projections",
           "adapted"]
