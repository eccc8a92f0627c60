"""Rollout engines by name: `rl.engine = "jax" | "vllm" | "openai" | <yours>`.

An engine module registers itself at import with

    @register_engine("name", ConfigClass, copies_weights=..., shareable=...,
                     processes=..., device_share=...)
    def build(cfg: ConfigClass, ctx: EngineContext) -> Engine: ...

`processes` says what it serves in a job of several processes: "each" (an engine per process,
any rollout source and episode), "lockstep" (one program of the whole job: only sources and
episodes whose every process makes the same calls in step) or "one" (a one-process learner
only). `device_share(cfg)` is the fraction of each learner accelerator the engine holds (an
in-process vLLM's `gpu_memory_utilization`), for the AOT memory check.

and optionally a `check(cfg, model_config, max_tokens, *, field, serving)` run before training
or serving starts (so a missing package or a setting the model cannot serve fails in the first
second, not after the SFT phase); `field` is where the config sits ("config.rl.engine_config"
for training), `serving` is True behind the proxy (launch/serve.py), which syncs no weights.
Every module of `posttrain_jax.engines` is imported on first lookup, so a new engine is one new
file (plus its test). The built engine's `update_weights` takes the learner's parameter dict
(with LoRA: the base joined with the adapters; `EngineContext.lora` says so, and an engine that
serves adapters, such as vLLM with `enable_lora`, sends the adapters alone).
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable, Optional

from flax import nnx

from posttrain_jax.models.lora import LoRAConfig
from posttrain_jax.registry import Registry


@dataclasses.dataclass(frozen=True)
class EngineContext:
  """What the run knows when it builds an engine."""
  model_dir: pathlib.Path         # HF directory of the RL start weights (served as version 0)
  model_config: Any               # its ModelConfig
  model: Any                      # the learner's Decoder (an embedded engine shares its arrays)
  graphdef: Any                   # the learner's graphdef: params dict -> Decoder
  max_prompt_len: int             # longest prompt (tokens) the run expects to send
  max_tokens: int                 # longest completion it asks for
  pad_id: int = 0                 # the tokenizer's pad id
  lora: LoRAConfig = LoRAConfig()  # the learner's adapters (rank 0: none); an engine that can
                                  # serve adapters on the start weights may sync them alone


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """A registered engine."""
  name: str
  config_cls: type
  build: Callable[[Any, EngineContext], Any]
  check: Optional[Callable[..., None]] = None  # (cfg, model_config, max_tokens, *, field, serving)
  copies_weights: bool = False    # update_weights copies what it is given (no copy needed first)
  shareable: bool = True          # one instance serves rollouts and eval; False = one each
  processes: str = "each"         # several processes: "each" | "lockstep" | "one" (docstring)
  device_share: Optional[Callable[[Any], float]] = None  # cfg -> share of a learner device

  def __post_init__(self):
    if self.processes not in PROCESSES:
      raise ValueError(f"engine {self.name!r}: processes={self.processes!r}; valid: {PROCESSES}")

  def share_of_device(self, cfg) -> float:
    return float(self.device_share(cfg)) if self.device_share is not None else 0.0


PROCESSES = ("each", "lockstep", "one")


ENGINES: Registry[EngineSpec] = Registry("rollout engine", discover="posttrain_jax.engines",
                                         skip=("registry",))


def register_engine(name: str, config_cls: type, *, check=None, copies_weights: bool = False,
                    shareable: bool = True, processes: str = "each",
                    device_share: Optional[Callable[[Any], float]] = None):
  """Decorator registering `build(cfg, ctx) -> Engine` under `name`."""
  def deco(build):
    ENGINES.register(name)(EngineSpec(name, config_cls, build, check, copies_weights, shareable,
                                      processes, device_share))
    return build
  return deco


def engine_spec(name: str) -> EngineSpec:
  return ENGINES.get(name)


def engine_names() -> list[str]:
  return ENGINES.names()


class DecoderWeights:
  """Engine wrapper for engines outside this process: the learner's params dict becomes a
  Decoder (HF names) before it is handed to the engine's `update_weights`."""

  def __init__(self, engine, graphdef):
    self.engine, self.graphdef = engine, graphdef

  @property
  def version(self) -> int:
    return self.engine.version

  def generate(self, *args, **kwargs):
    return self.engine.generate(*args, **kwargs)

  def update_weights(self, params, version: int) -> None:
    self.engine.update_weights(nnx.merge(self.graphdef, params), version)

  def __getattr__(self, name):  # close(), last_weight_sync, ...
    return getattr(self.engine, name)
