"""Single-turn rollouts: task -> prompt ids -> G completions -> graded Trajectories.

The trajectory's `token_ids` are the prompt ids we sent plus the ids the engine returned;
the completion *text* is decoded only for the grader. Failure semantics (ARCHITECTURE.md):
- the engine raising -> every trajectory of the group is `infra_error` (never reward 0);
- the grader raising (e.g. an unreadable reference answer) -> `infra_error` for that one;
- `finish_reason == "length"` -> `truncated`: graded as usual ("grade"), given reward 0
  ("penalise"), or graded but left out of the loss ("mask"); always counted.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Sequence

from posttrain_jax.engines.base import Completion, Engine, SamplingParams
from posttrain_jax.envs import GradeResult, Task
from posttrain_jax.types import Source, Status, Trajectory

TRUNCATION_POLICIES = ("grade", "penalise", "mask")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """How prompts are sampled and graded."""
  group_size: int = 8             # completions per prompt (G)
  max_tokens: int = 16            # new tokens per completion
  temperature: float = 1.0        # sampling temperature (the learner uses the same)
  top_p: float = 1.0              # nucleus sampling mass
  top_k: int = 0                  # top-k sampling (0 = off)
  truncation: str = "grade"       # "grade" | "penalise" (reward 0) | "mask" (no loss, counted)

  def __post_init__(self):
    if self.truncation not in TRUNCATION_POLICIES:
      raise ValueError(f"RolloutConfig.truncation={self.truncation!r}; valid: {TRUNCATION_POLICIES}")

  def sampling(self, stop_token_ids: Sequence[int]) -> SamplingParams:
    return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature,
                          top_p=self.top_p, top_k=self.top_k, stop_token_ids=tuple(stop_token_ids))


def encode_prompt(tokenizer, task: Task) -> list[int]:
  """Prompt ids through the tokenizer's chat template (generation prompt appended)."""
  out = tokenizer.apply_chat_template(task.messages, add_generation_prompt=True, tokenize=True)
  ids = out["input_ids"] if hasattr(out, "keys") else out
  return list(ids)


def _trajectory(task: Task, group_id: str, idx: int, prompt_ids: list[int], comp: Completion,
                text: str, grade: Optional[GradeResult], status: Status, cfg: RolloutConfig,
                metrics: dict) -> Trajectory:
  n = len(comp.token_ids)
  reward = None if grade is None else grade.reward
  loss_mask = [0] * len(prompt_ids) + [1] * n
  if status is Status.TRUNCATED:
    if cfg.truncation == "penalise":
      reward = 0.0
    elif cfg.truncation == "mask":
      loss_mask = [0] * (len(prompt_ids) + n)
  info = {} if grade is None else {k: v for k, v in grade.info.items()
                                   if isinstance(v, (int, float, str, bool)) or v is None}
  return Trajectory(
      id=f"{group_id}/{idx}", task_id=task.id, group_id=group_id, source=Source.TASK_BANK,
      token_ids=prompt_ids + comp.token_ids, loss_mask=loss_mask,
      behaviour_logprobs=[0.0] * len(prompt_ids) + list(comp.logprobs),
      policy_version=[-1] * len(prompt_ids) + [comp.version] * n,
      messages=[*task.messages, {"role": "assistant", "content": text}],
      reward=reward, status=status,
      metrics={"response_len": float(n), **metrics, **{f"grade/{k}": v for k, v in info.items()
                                                       if isinstance(v, (int, float, bool))}})


def rollout_groups(engine: Engine, tasks: Sequence[Task], tokenizer, grader: Callable,
                   cfg: RolloutConfig, stop_token_ids: Sequence[int], seed: int,
                   step: int) -> list[Trajectory]:
  """G graded trajectories per task (group ids `"{step}/{task.id}"`), in task order."""
  prompts = [encode_prompt(tokenizer, t) for t in tasks]
  t0 = time.perf_counter()
  try:
    groups = engine.generate(prompts, cfg.sampling(stop_token_ids), n=cfg.group_size, seed=seed)
    error = None
  except Exception as e:  # noqa: BLE001 -- any engine failure is ours, not the policy's
    groups, error = None, f"{type(e).__name__}: {e}"
  gen_s = time.perf_counter() - t0
  out = []
  for ti, (task, prompt) in enumerate(zip(tasks, prompts)):
    gid = f"{step}/{task.id}"
    if groups is None:
      for j in range(cfg.group_size):
        empty = Completion(token_ids=[], logprobs=[], finish_reason="error", version=engine.version)
        out.append(_trajectory(task, gid, j, prompt, empty, "", None, Status.INFRA_ERROR, cfg,
                               {"infra_error": 1.0, "error": error}))
      continue
    for j, comp in enumerate(groups[ti]):
      text = tokenizer.decode(comp.token_ids, skip_special_tokens=True)
      status = Status.TRUNCATED if comp.finish_reason == "length" else Status.OK
      try:
        grade = grader(text, task)
      except Exception as e:  # noqa: BLE001 -- a grader bug or bad reference: not the policy's fault
        out.append(_trajectory(task, gid, j, prompt, comp, text, None, Status.INFRA_ERROR, cfg,
                               {"infra_error": 1.0, "error": f"grader: {type(e).__name__}: {e}"}))
        continue
      out.append(_trajectory(task, gid, j, prompt, comp, text, grade, status, cfg,
                             {"generate_s": gen_s / max(len(tasks), 1)}))
  return out


class SyncRollouts:
  """Generate-then-train (the on-policy baseline): each step samples fresh groups with the
  weights of the previous update. The trainer talks to any rollout source through these
  methods (`update_weights`, `collect`, `metrics`, `state`/`restore`, `close`), so an
  asynchronous source (actors/pool.py: actor pool + replay queue) can stand in for this one.
  """

  def __init__(self, engine: Engine, tasks, tokenizer, grader: Callable, cfg: RolloutConfig,
               stop_token_ids: Sequence[int], prompts_per_step: int, seed: int = 0):
    self.engine, self.tasks, self.tokenizer, self.grader = engine, tasks, tokenizer, grader
    self.cfg, self.stop_token_ids = cfg, tuple(stop_token_ids)
    self.prompts_per_step, self.seed = prompts_per_step, seed

  def update_weights(self, params, version: int) -> None:
    self.engine.update_weights(params, version)

  def collect(self, step: int) -> tuple[list[Task], list[Trajectory]]:
    """The tasks drawn for `step` and their graded trajectories (G per task)."""
    tasks = [next(self.tasks) for _ in range(self.prompts_per_step)]
    seed = (self.seed * 1_000_003 + step) % (2**31)
    return tasks, rollout_groups(self.engine, tasks, self.tokenizer, self.grader, self.cfg,
                                 self.stop_token_ids, seed=seed, step=step)

  def metrics(self) -> dict[str, float]:
    """Per-step source metrics (none here; the async source reports its queue and pool)."""
    return {}

  def state(self) -> dict:
    return {}

  def restore(self, state: dict) -> None:
    del state

  def close(self) -> None:
    pass
