"""`RunConfig`: the whole synchronous run (model, tasks, SFT warm-start, GRPO, eval, checkpoints).

Each field is a component's own config dataclass; `configs/*.py` build them as ConfigDicts
and `launch/train.py` turns flags into a RunConfig through `run_config_from_dict`, which
type-checks every field and names the one that is wrong.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from posttrain_jax.actors.episode import RetryConfig, episode_spec
from posttrain_jax.actors.pool import PoolConfig
from posttrain_jax.actors.rollout import RolloutConfig
from posttrain_jax.advantages import ADVANTAGE_ESTIMATORS, AdvantageConfig
from posttrain_jax.batching import BatchConfig
from posttrain_jax.byoh.trace_source import TraceSourceConfig
from posttrain_jax.checkpoint import CheckpointConfig
from posttrain_jax.config_io import config_dict_of, from_dict
from posttrain_jax.engines.registry import engine_names, engine_spec
from posttrain_jax.tasks import GENERATORS, TaskBankConfig
from posttrain_jax.graders import GRADERS
from posttrain_jax.learner import LearnerConfig, OptimizerConfig
from posttrain_jax.losses import CISPOConfig, GRPOConfig, get_loss
from posttrain_jax.losses.off_policy import CORRECTIONS
from posttrain_jax.models.tiny import TinyModelConfig
from posttrain_jax.overlap import AutoModeConfig
from posttrain_jax.replay import ReplayConfig
from posttrain_jax.run.sources import source_names, source_spec
from posttrain_jax.sharding import MeshConfig
from posttrain_jax.teacher import FIELDS as TEACHER_FIELDS, TeacherConfig


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """Where the initial weights come from."""
  path: Optional[str] = None      # a HF model directory or a .gguf file; None = the tiny model
  tiny: TinyModelConfig = TinyModelConfig()  # the locally built model (no downloads)
  param_dtype: str = "float32"    # master weights
  compute_dtype: str = "float32"  # activations / matmuls
  remat: bool = False             # recompute block activations in the backward pass
  chat_template: Optional[str] = None  # replaces the checkpoint's template: a chat format
                                  # (models/chat_templates.py, e.g. "hermes": tools) or a file
  arch: Optional[str] = None      # a published architecture (models/published.py) this run is
                                  # sized for; then `path` is required (nothing is downloaded),
                                  # and launch/aot_check.py checks memory from it without weights

  def __post_init__(self):
    if self.arch is None:
      return
    from posttrain_jax.models.published import hf_config
    hf_config(self.arch)  # an unknown name lists the known ones
    if not self.path:
      raise ValueError(f"model.path is required: model.arch={self.arch!r} is sized for that "
                       "checkpoint and nothing is downloaded; give --config.model.path=<a local "
                       f"HF directory of {self.arch}> (config.json, *.safetensors, tokenizer). "
                       "launch/aot_check.py checks its memory without one")


@dataclasses.dataclass(frozen=True)
class SFTPhaseConfig:
  """Supervised warm-start on the task bank's reference solutions (0 steps = skip)."""
  steps: int = 0                  # optimizer steps
  batch_size: int = 64            # sequences per step
  answer_style: str = "plain"     # solution_text style: "plain" | "boxed"
  learner: LearnerConfig = LearnerConfig(loss="sft")
  batch: BatchConfig = BatchConfig(rows=32, seq_len=48, max_seqs=64)


@dataclasses.dataclass(frozen=True)
class RLPhaseConfig:
  """GRPO-family training on graded rollouts from the rollout source `mode` (run/sources/):
  generate-then-train ("sync", on-policy), an actor pool sampling while the learner trains
  ("async", bounded staleness, see actors/pool.py), graded sessions recorded by the proxy
  ("traces", byoh/trace_source.py: one trajectory per task, so the `running` baseline;
  prompts_per_step sessions a step), the same while serving the policy ("online"), or "auto":
  sync, turning async after `auto.probe_steps` steps where the measured bound says overlap
  pays (overlap.py)."""
  mode: str = "sync"              # a rollout source (run/sources/): sync | async | auto |
                                  # traces | online
  auto: AutoModeConfig = AutoModeConfig()  # auto: the probe and the gain it must predict
  engine: str = "jax"             # rollout engine (engines/registry.py): jax | vllm | openai
  engine_config: Any = None       # that engine's config (class from the registry); None = defaults
  episode: str = "task"           # what a rollout is (actors/episode.py registry): "task" = single-turn
  episode_config: Any = None      # that episode type's config; None = defaults
  replay: ReplayConfig = ReplayConfig()  # async: the replay queue (max_staleness, filter, ...)
  pool: PoolConfig = PoolConfig()  # async: the actor pool (concurrency, shutdown)
  retry: RetryConfig = RetryConfig()  # failed episodes: retries with backoff, requeues (both modes)
  traces: TraceSourceConfig = TraceSourceConfig()  # traces / online: the store, which sessions
  async_correction: str = "tis"   # async / traces: correction used when the loss's is "none"
                                  # ("none" = off)
  steps: int = 100                # optimizer steps
  prompts_per_step: int = 32      # tasks per step; each is sampled rollout.group_size times
  oversample: float = 0.0         # sync: draw ceil(prompts_per_step·(1 + oversample)) tasks a
                                  # step, train prompts_per_step of their groups, those with a
                                  # learning signal first (DAPO's dynamic sampling, one round;
                                  # rl_step.py); 0 = off. Async filters with replay.filter
  rollout: RolloutConfig = RolloutConfig()
  advantage: AdvantageConfig = AdvantageConfig()
  learner: LearnerConfig = LearnerConfig(loss="grpo")
  loss: Any = None                # the loss's own config (class from the registry); None = defaults
  update_epochs: int = 1          # optimizer steps per batch; > 1 recomputes log pi_old first
  reference_kl: bool = True       # report KL to pi_ref (the warm-start model), the `kl` metric, every
                                  # rl_step.KL_EVERY (10) steps (a forward pass of its own); a loss
                                  # with kl_coef > 0 gets pi_ref every step
  teacher: TeacherConfig = TeacherConfig()  # a distillation loss's teacher (teacher.py): context, weights
  batch: BatchConfig = BatchConfig(rows=128, seq_len=48, max_seqs=256)

  def __post_init__(self):
    if self.mode not in source_names():
      raise ValueError(f"RLPhaseConfig.mode is {self.mode!r}; valid: {source_names()}")
    source = source_spec(self.mode)
    if self.engine not in engine_names():
      raise ValueError(f"RLPhaseConfig.engine is {self.engine!r}; valid: {engine_names()}")
    CORRECTIONS.get(self.async_correction)
    episode_spec(self.episode)
    for name in ("steps", "prompts_per_step", "update_epochs"):
      low = 0 if name == "steps" else 1
      if getattr(self, name) < low:
        raise ValueError(f"RLPhaseConfig.{name} must be ≥ {low}, got {getattr(self, name)}")
    if not self.oversample >= 0:
      raise ValueError(f"RLPhaseConfig.oversample must be ≥ 0, got {self.oversample}")
    if self.oversample > 0 and not source.oversamples:
      raise ValueError(f"rl.oversample={self.oversample} draws extra prompts in sync rollouts; "
                       f"rl.mode={self.mode!r} does not draw them (async: replay.filter="
                       "'zero_variance' keeps only groups with a signal)")
    g = self.rollout.group_size
    if ADVANTAGE_ESTIMATORS.get(self.advantage.estimator).kind == "group" and g < 2:
      raise ValueError(f"advantage.estimator={self.advantage.estimator!r} is a group baseline: it "
                       f"needs rollout.group_size ≥ 2 (got {g}); for one sample per prompt use "
                       "'running'")
    if not source.groups and ADVANTAGE_ESTIMATORS.get(self.advantage.estimator).kind == "group":
      raise ValueError(f"rl.mode={self.mode!r} trains on single trajectories (no groups): "
                       f"advantage.estimator={self.advantage.estimator!r} needs groups; use "
                       "'running'")
    if self.prompts_per_step * (g if source.groups else 1) > self.batch.max_seqs:
      raise ValueError(f"prompts_per_step × rollout.group_size = {self.prompts_per_step * g} "
                       f"sequences exceed batch.max_seqs={self.batch.max_seqs}")
    ep = (self.episode_config if self.episode_config is not None
          else episode_spec(self.episode).config_cls())
    context = getattr(ep, "max_context_tokens", None)
    if context is not None and context > self.batch.seq_len:
      raise ValueError(f"episode_config.max_context_tokens={context} > batch.seq_len="
                       f"{self.batch.seq_len}: an episode's sample would not fit a batch row; "
                       "raise batch.seq_len or lower max_context_tokens")

@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Held-out accuracy: tasks never seen in training, graded like training rollouts."""
  every_steps: int = 50           # evaluate every N RL steps (and before/after); 0 = only before/after
  samples_per_prompt: int = 4     # completions per held-out task at `temperature`
  temperature: float = 1.0        # the policy's sampling temperature (accuracy = mean reward)
  greedy: bool = True             # also report greedy (temperature 0) accuracy ("accuracy_greedy")
  sampled: bool = True            # report sampled accuracy ("accuracy"); False + greedy = greedy only
  max_tokens: int = 16            # new tokens per completion
  target_accuracy: Optional[float] = None  # end RL once an in-run eval's `target_metric` reaches
                                  # this (checked every `every_steps`); None = run all rl.steps
  target_metric: str = "accuracy_greedy"  # the metric held to the target: "accuracy" | "accuracy_greedy"

  def __post_init__(self):
    if not (self.sampled or self.greedy):
      raise ValueError("EvalConfig.sampled and EvalConfig.greedy are both False: no held-out "
                       "accuracy would be measured; keep at least one")
    if self.sampled and self.samples_per_prompt < 1:
      raise ValueError(f"EvalConfig.samples_per_prompt must be ≥ 1 with sampled=True, got "
                       f"{self.samples_per_prompt}")
    if self.target_metric not in EVAL_METRICS:
      raise ValueError(f"EvalConfig.target_metric is {self.target_metric!r}; valid: {EVAL_METRICS}")
    if self.target_accuracy is None:
      return
    if not 0.0 < self.target_accuracy <= 1.0:
      raise ValueError(f"EvalConfig.target_accuracy must be in (0, 1], got {self.target_accuracy}")
    measured = self.greedy if self.target_metric == "accuracy_greedy" else self.sampled
    if not measured:
      raise ValueError(f"EvalConfig.target_metric={self.target_metric!r} is not measured (greedy="
                       f"{self.greedy}, sampled={self.sampled}): turn it on or pick the other")
    if self.every_steps < 1:
      raise ValueError(f"EvalConfig.target_accuracy is checked at in-run evals: every_steps must "
                       f"be ≥ 1, got {self.every_steps}")


EVAL_METRICS = ("accuracy", "accuracy_greedy")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A whole run."""
  workdir: str = "runs/default"   # checkpoints, metrics.jsonl, tensorboard/, plot.png
  seed: int = 0                   # sampling seeds derive from (seed, step)
  model: ModelSource = ModelSource()
  tasks: TaskBankConfig = TaskBankConfig()
  grader: str = "numeric"         # a name in posttrain_jax.graders.GRADERS
  grader_config: Any = None       # that grader's config (class from the registry, e.g. numeric:
                                  # {"pick": "first"}); None = defaults
  sft: SFTPhaseConfig = SFTPhaseConfig()
  rl: RLPhaseConfig = RLPhaseConfig()
  eval: EvalConfig = EvalConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  mesh: MeshConfig = MeshConfig()
  stop_after_step: Optional[int] = None  # end the process after this global step (tests, preemption drills)
  train_budget_s: Optional[float] = None  # end RL once this many seconds were spent in training
                                  # steps (time/train_s_total: SFT + RL, evals and saves excluded)

  def __post_init__(self):
    try:
      spec = GRADERS.get(self.grader)
    except KeyError as e:             # the registry's message lists the registered names
      raise ValueError(f"grader={self.grader!r}: {e.args[0]}") from None
    if self.grader_config is not None and not isinstance(self.grader_config, spec.config_cls):
      raise ValueError(f"grader_config is a {type(self.grader_config).__name__}; grader "
                       f"{self.grader!r} takes a {spec.config_cls.__name__}")
    if self.train_budget_s is not None and not self.train_budget_s > 0:
      raise ValueError(f"train_budget_s must be > 0 seconds (or None), got {self.train_budget_s}")
    if self.sft.steps and self.sft.batch_size > self.sft.batch.max_seqs:
      raise ValueError(f"sft.batch_size={self.sft.batch_size} exceeds "
                       f"sft.batch.max_seqs={self.sft.batch.max_seqs}")
    needs = get_loss(self.rl.learner.loss).needs(self.loss_config())
    if "teacher_logp" in needs and "teacher_mask" not in needs:
      raise ValueError(f"loss {self.rl.learner.loss!r} reads teacher_logp but not teacher_mask: "
                       "the self-teacher (teacher.py) scores only samples with context and leaves "
                       "0 elsewhere, which this loss would train towards; use 'sampled_distill'")
    source = source_spec(self.rl.mode)
    if self.rl.learner.lora.tenants and not source.tenants:
      raise ValueError(f"rl.learner.lora.tenants={list(self.rl.learner.lora.tenants)}: "
                       f"rl.mode={self.rl.mode!r} does not know whose a sample is; per-tenant "
                       f"adapters train from recorded sessions (modes "
                       f"{[n for n in source_names() if source_spec(n).tenants]})")
    if self.sft.learner.lora.tenants:
      raise ValueError("sft.learner.lora.tenants: the SFT warm-start trains one model; name "
                       "tenants in rl.learner.lora.tenants")
    if source.check is not None:
      source.check(self)
    distills = self.distills()
    if distills and self.rl.update_epochs > 1:
      raise ValueError(f"rl.update_epochs={self.rl.update_epochs} with a distillation loss: the "
                       "teacher scores a batch once, before its first update; use 1")

  def loss_config(self, off_policy: Optional[bool] = None):
    """The RL loss's config. For off-policy samples (`off_policy`; default: whether rl.mode's
    source yields them at the start of a run; "auto" starts on-policy), a loss that can correct
    them and was given no correction gets `rl.async_correction`: stale samples are never trained
    as on-policy silently. A loss without a correction slot trains them as given."""
    if off_policy is None:
      off_policy = source_spec(self.rl.mode).off_policy
    spec = get_loss(self.rl.learner.loss)
    cfg = self.rl.loss if self.rl.loss is not None else spec.config_cls()
    names = {f.name for f in dataclasses.fields(cfg)}
    if (off_policy and "correction" in names and cfg.correction == "none"
        and self.rl.async_correction != "none"):
      cfg = dataclasses.replace(cfg, correction=self.rl.async_correction, correction_cfg=None)
    return cfg

  def distills(self) -> bool:
    """The RL loss reads a teacher's fields (a distillation loss)."""
    return bool(get_loss(self.rl.learner.loss).needs(self.loss_config()) & TEACHER_FIELDS)

  def episode_config(self):
    """The episode type's config (`rl.episode_config`, or its defaults)."""
    spec = episode_spec(self.rl.episode)
    return self.rl.episode_config if self.rl.episode_config is not None else spec.config_cls()

  def grader_cfg(self):
    """The grader's config (`grader_config`, or its defaults)."""
    spec = GRADERS.get(self.grader)
    return self.grader_config if self.grader_config is not None else spec.config_cls()

  def engine_config(self):
    """The rollout engine's config (`rl.engine_config`, or its defaults)."""
    spec = engine_spec(self.rl.engine)
    return self.rl.engine_config if self.rl.engine_config is not None else spec.config_cls()


def _field(x, name):
  return x[name] if isinstance(x, Mapping) else getattr(x, name)


_DYNAMIC = {
    (RLPhaseConfig, "loss"): lambda v: get_loss(_field(v["learner"], "loss")).config_cls,
    (RLPhaseConfig, "engine_config"): lambda v: engine_spec(v["engine"]).config_cls,
    (RLPhaseConfig, "episode_config"): lambda v: episode_spec(v["episode"]).config_cls,
    (TaskBankConfig, "generator_config"): lambda v: GENERATORS.get(v["generator"]).config_cls,
    (RunConfig, "grader_config"): lambda v: GRADERS.get(v["grader"]).config_cls,
    (GRPOConfig, "correction_cfg"): lambda v: CORRECTIONS.get(v["correction"]).config_cls,
    (CISPOConfig, "correction_cfg"): lambda v: CORRECTIONS.get(v["correction"]).config_cls,
}


def base_config():
  """Every RunConfig field with its default, as a ConfigDict (so any field can be overridden
  from the command line); `configs/*.py` start from this and change what they need."""
  return config_dict_of(RunConfig())


def run_config_from_dict(d: Mapping[str, Any]) -> RunConfig:
  """A RunConfig from nested dicts; errors name the field path."""
  return from_dict(RunConfig, d, "config", _DYNAMIC)


__all__ = ["RunConfig", "ModelSource", "SFTPhaseConfig", "RLPhaseConfig", "EvalConfig",
           "OptimizerConfig", "ReplayConfig", "PoolConfig", "run_config_from_dict"]
