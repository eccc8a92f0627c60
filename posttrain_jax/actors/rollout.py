"""Single-turn rollouts (`TaskEpisode`) and the generate-then-train source (`SyncRollouts`).

    task -> prompt ids (chat template, once) -> G completions -> graded Trajectories

The trajectory's `token_ids` are the prompt ids we sent plus the ids the engine returned; the
completion *text* is decoded only for the grader. How a completion ended decides its status,
for every finish reason an engine can return (`FINISH_STATUS`):
- "stop"   -> `ok`, graded;
- "length" -> `truncated`: graded as usual ("grade"), given reward 0 ("penalise"), or graded but
  left out of the loss ("mask"); always counted;
- "abort"  (cut in flight by a weight update) and "error" -> `infra_error`: a cut answer is not
  the policy's answer, so it is never graded, never in a baseline, and counted by reason;
- anything else -> `infra_error` naming the unknown reason (an engine we do not understand is
  our problem, not the policy's).
The G completions of a task are graded together (`grade_group`, graders/base.py: a judge scores
them relative to each other in one call); a grader failing (an unreadable reference answer, a
judge down or answering garbage) -> `infra_error` for the completions it failed on (for a group
grader, the whole group), never a reward of 0.
The engine raising -> the episode raises; the source retries / requeues (actors/episode.py).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import time
from typing import Callable, Optional, Sequence

from posttrain_jax.actors.episode import (
    DemoContext, EngineLimits, EpisodeContext, InvalidTaskError, RetryConfig, WorkItem, all_infra, drop_invalid,
    episode_metrics, infra_group, register_episode, requeue_or_give_up)
from posttrain_jax.actors.source import SourceBase, check_kind
from posttrain_jax.batching import sft_trajectory
from posttrain_jax.engines.base import (
    Completion, Engine, PromptTooLongError, SamplingParams, engine_metrics)
from posttrain_jax.graders import GradeResult, grade_group, grader_metrics
from posttrain_jax.tasks import Task, solution_text
from posttrain_jax.errors import UserError
from posttrain_jax.types import Source, Status, Trajectory

TRUNCATION_POLICIES = ("grade", "penalise", "mask")
FINISH_STATUS = {"stop": Status.OK, "length": Status.TRUNCATED,
                 "abort": Status.INFRA_ERROR, "error": Status.INFRA_ERROR}


class DataExhaustedError(UserError):
  """The task bank ran out (a finite `tasks.num_epochs`) before the run's steps were done."""


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
    for name in ("group_size", "max_tokens"):
      if getattr(self, name) < 1:
        raise ValueError(f"RolloutConfig.{name} must be ≥ 1, got {getattr(self, name)}")
    if self.temperature < 0:
      raise ValueError(f"RolloutConfig.temperature must be ≥ 0, got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"RolloutConfig.top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0:
      raise ValueError(f"RolloutConfig.top_k must be ≥ 0, got {self.top_k}")

  def sampling(self, stop_token_ids: Sequence[int]) -> SamplingParams:
    return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature,
                          top_p=self.top_p, top_k=self.top_k, stop_token_ids=tuple(stop_token_ids))


def encode_messages(tokenizer, messages: list, tools: Optional[list] = None) -> list[int]:
  """A chat's ids through the tokenizer's chat template (generation prompt appended), with
  `tools` (OpenAI format) where the template shows them."""
  extra = {"tools": tools} if tools else {}   # a tool-free chat renders as it always did
  out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
  ids = out["input_ids"] if hasattr(out, "keys") else out
  return list(ids)


def encode_prompt(tokenizer, task: Task) -> list[int]:
  """A task's prompt ids through the tokenizer's chat template (generation prompt appended)."""
  return encode_messages(tokenizer, task.messages)


def _trajectory(item: WorkItem, idx: int, prompt_ids: list[int], comp: Completion, text: str,
                grade: Optional[GradeResult], status: Status, cfg: RolloutConfig,
                metrics: dict) -> Trajectory:
  task = item.task
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
  feedback = info.get("feedback")   # a grader's free text on the attempt (teacher.py reads it)
  return Trajectory(
      id=f"{item.group_id}/{idx}", task_id=task.id, group_id=item.group_id,
      source=Source.TASK_BANK, token_ids=prompt_ids + comp.token_ids, loss_mask=loss_mask,
      behaviour_logprobs=[0.0] * len(prompt_ids) + list(comp.logprobs),
      policy_version=[-1] * len(prompt_ids) + [comp.version] * n,
      messages=[*task.messages, {"role": "assistant", "content": text}],
      reward=reward, status=status, feedback=feedback if isinstance(feedback, str) else None,
      metrics={"response_len": float(n), "draw": item.draw, "requeues": item.requeues,
               "finish_reason": comp.finish_reason, **metrics,
               **{f"grade/{k}": v for k, v in info.items() if isinstance(v, (int, float, bool))}})


class TaskEpisode:
  """Single-turn task-bank episodes: one engine call for the whole batch (G samples per task),
  each completion graded; see the module docstring for statuses."""

  def __init__(self, engine: Engine, tokenizer, grader: Callable, cfg: RolloutConfig,
               stop_token_ids: Sequence[int]):
    self.engine, self.tokenizer, self.grader, self.cfg = engine, tokenizer, grader, cfg
    self.stop_token_ids = tuple(stop_token_ids)

  def run(self, items: Sequence[WorkItem], seed: int) -> list[list[Trajectory]]:
    prompts = [encode_prompt(self.tokenizer, it.task) for it in items]
    t0 = time.perf_counter()
    try:
      groups = self.engine.generate(prompts, self.cfg.sampling(self.stop_token_ids),
                                    n=self.cfg.group_size, seed=seed)
    except PromptTooLongError as e:
      raise InvalidTaskError(e.index, str(e)) from e
    per_task_s = (time.perf_counter() - t0) / max(len(items), 1)
    return [self._group(item, prompt, comps, per_task_s)
            for item, prompt, comps in zip(items, prompts, groups)]

  def _group(self, item, prompt, comps, gen_s) -> list[Trajectory]:
    texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in comps]
    statuses = [FINISH_STATUS.get(c.finish_reason) for c in comps]
    gradable = [j for j, s in enumerate(statuses) if s not in (None, Status.INFRA_ERROR)]
    grades = dict(zip(gradable, grade_group(self.grader, [texts[j] for j in gradable],
                                            item.task)))
    out = []
    for j, comp in enumerate(comps):
      status = statuses[j]
      if status is None or status is Status.INFRA_ERROR:
        why = (f"finish_reason {comp.finish_reason!r}" if status is not None
               else f"unknown finish_reason {comp.finish_reason!r}")
        out.append(_trajectory(item, j, prompt, comp, texts[j], None, Status.INFRA_ERROR,
                               self.cfg, {"infra_error": 1.0, "error": why,
                                          f"infra/{comp.finish_reason}": 1.0}))
      elif isinstance(grades[j], Exception):  # a grader bug, a bad reference, a judge down: ours
        e = grades[j]
        out.append(_trajectory(item, j, prompt, comp, texts[j], None, Status.INFRA_ERROR,
                               self.cfg, {"infra_error": 1.0, "infra/grader": 1.0,
                                          "error": f"grader: {type(e).__name__}: {e}"}))
      else:
        out.append(_trajectory(item, j, prompt, comp, texts[j], grades[j], status, self.cfg,
                               {"generate_s": gen_s}))
    return out

  def metrics(self) -> dict[str, float]:
    """The grader's own counters since the last call (a judge's judge/requests, cache_hits,
    failures, ...); both sources log an episode's metrics each step."""
    return grader_metrics(self.grader)


@dataclasses.dataclass(frozen=True)
class TaskEpisodeConfig:
  """Single-turn episodes take their settings from `rl.rollout` (RolloutConfig)."""


def _evaluate(episode: TaskEpisode, tasks, temperature: float, n: int, max_tokens: int,
              seed: int) -> dict[str, float]:
  """The mean reward of `n` completions per held-out task at `temperature` ("accuracy"), and
  what tells a policy that learned the task from one that collapsed onto a frequent answer:

      solved_frac         share of the completions that scored 1.0 (below the accuracy where
                          the grader gives partial credit: spell_backward scores each letter)
      top_reply_frac      share of the completions that are the most common one (its text,
                          stripped): 1.0 = one reply to every task
      constant_baseline   share of the tasks whose reference answer is the most common one:
                          what the best single answer scores under exact match (tasks
                          with an empty answer left out; partial-credit graders may give more)

  (SmolLM2 on reasoning-gym gcd reached 0.332 = gcd's constant_baseline, every reply "2".)
  top_reply_frac compares whole replies: a policy that reasons in varied words before one
  collapsed answer reads low on it (compare its accuracy with constant_baseline then). On
  several processes both shares are the mean of each shard's, an upper bound of the whole
  set's (a shard's most common value is at least as frequent there as the set's)."""
  prompts = [encode_prompt(episode.tokenizer, t) for t in tasks]
  sp = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                      stop_token_ids=episode.stop_token_ids)
  groups = episode.engine.generate(prompts, sp, n=n, seed=seed)
  texts = [(episode.tokenizer.decode(c.token_ids, skip_special_tokens=True), t)
           for comps, t in zip(groups, tasks) for c in comps]
  rewards = [episode.grader(text, t).reward for text, t in texts]
  nan = float("nan")
  out = {"accuracy": float(sum(rewards) / len(rewards)) if rewards else nan,
         "count": float(len(rewards))}
  # every key on every process, NaN where undefined: the eval averages each over the processes
  # with one collective per key (run/evaluation.py), so all must report the same keys
  out["solved_frac"] = sum(r == 1.0 for r in rewards) / len(rewards) if rewards else nan
  out["top_reply_frac"] = top_share([text.strip() for text, _ in texts])
  out["constant_baseline"] = top_share([t.answer.strip() for t in tasks if t.answer.strip()])
  return out


def top_share(values: list[str]) -> float:
  """The share of `values` equal to the most common one (NaN for none): over replies, how
  collapsed a policy is; over reference answers, what one answer to every task scores."""
  if not values:
    return float("nan")
  return collections.Counter(values).most_common(1)[0][1] / len(values)


def _demonstration(cfg: TaskEpisodeConfig, demo: DemoContext, task: Task, tid: str) -> Trajectory:
  """The prompt, then the task's solution (in `answer_style`) and the end-of-turn token."""
  del cfg
  tok = demo.tokenizer
  eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
  answer = tok.encode(solution_text(task, demo.answer_style), add_special_tokens=False)
  return sft_trajectory(encode_prompt(tok, task), answer + eos, tid, task.id)


def _limits(cfg: TaskEpisodeConfig, rollout: RolloutConfig, eval_max_tokens: int,
            longest_prompt: Callable[[], int]) -> EngineLimits:
  del cfg
  return EngineLimits(longest_prompt(), max(rollout.max_tokens, eval_max_tokens),
                      rollout.max_tokens)


@register_episode("task", TaskEpisodeConfig, evaluate=_evaluate, demonstration=_demonstration,
                  limits=_limits, lockstep=True)
def _build_task_episode(cfg: TaskEpisodeConfig, ctx: EpisodeContext) -> TaskEpisode:
  del cfg
  return TaskEpisode(ctx.engine, ctx.tokenizer, ctx.grader, ctx.rollout, ctx.stop_token_ids)


def exhausted(drawn: int) -> DataExhaustedError:
  """The error for a task bank that ran out after `drawn` tasks."""
  return DataExhaustedError(
      f"the task bank is exhausted after {drawn} tasks (TaskBankConfig.num_epochs passes over "
      "the data); set tasks.num_epochs higher, or None to cycle, or train fewer steps")


def draw_task(tasks, drawn: int):
  """next(tasks), or DataExhaustedError saying how many tasks the run had drawn."""
  try:
    return next(tasks)
  except StopIteration:
    raise exhausted(drawn) from None


class SyncRollouts(SourceBase):
  """Generate-then-train (the on-policy baseline): each step runs one episode batch of
  `prompts_per_step` tasks with the weights of the previous update (the rollout-source protocol,
  actors/source.py). With `train_groups` (rl.oversample) it draws more tasks than a step trains
  and the step trains `train_groups` of their groups, signal first (rl_step.py).

  Failures (actors/episode.py): a failed batch is retried with backoff; tasks of a batch that
  failed every attempt are requeued (run first next step) up to `retry.max_requeues` times and
  are `infra_error` in this step's trajectories (excluded from loss and baselines); a task that
  can never run is dropped as "invalid". Every case is counted in `metrics()`.
  """

  def __init__(self, episode, tasks, group_size: int, prompts_per_step: int, seed: int = 0,
               retry: RetryConfig = RetryConfig(), sleep: Callable[[float], None] = time.sleep,
               train_groups: Optional[int] = None):
    self.episode, self.tasks, self.group_size = episode, tasks, group_size
    self.train_groups = train_groups
    self.prompts_per_step, self.seed, self.retry, self._sleep = prompts_per_step, seed, retry, sleep
    self._next_draw = 0
    self._requeued: list[WorkItem] = []
    self._counters = dict.fromkeys(
        ("engine_errors", "retries", "requeued", "given_up", "invalid"), 0)
    self._window = dict(self._counters)

  @property
  def engine(self):
    return self.episode.engine

  def update_weights(self, params, version: int) -> None:
    self.engine.update_weights(params, version)

  def _draw(self, n: int) -> list[WorkItem]:
    items = self._requeued[:n]
    self._requeued = self._requeued[n:]
    while len(items) < n:
      items.append(WorkItem(self._next_draw, draw_task(self.tasks, self._next_draw)))
      self._next_draw += 1
    return items

  def collect(self, step: int) -> tuple[list[Task], list[Trajectory]]:
    """The tasks run for `step` and their trajectories (G per task; infra groups included)."""
    items = self._draw(self.prompts_per_step)
    base_seed = (self.seed * 1_000_003 + step) % (2**31)
    groups: dict[int, list[Trajectory]] = {}
    todo, attempt = list(items), 0
    while todo:
      try:
        out = self.episode.run(todo, (base_seed + 7919 * attempt) % (2**31))
        if inspect.isawaitable(out):  # an async episode (multi-turn): run it to completion
          out = asyncio.run(out)
      except InvalidTaskError as e:
        todo, bad = drop_invalid(todo, e)
        self._counters["invalid"] += 1
        items.remove(bad)
        continue
      except Exception as e:  # noqa: BLE001 -- ours (engine, network): retried, never reward 0
        self._counters["engine_errors"] += 1
        if attempt < self.retry.max_retries:
          attempt += 1
          self._counters["retries"] += 1
          self._sleep(self.retry.delay(attempt))
          continue
        for item in todo:
          groups[item.draw] = infra_group(item, self.group_size, e, self.engine.version)
          self._requeue(item)
        break
      for item, group in zip(todo, out):
        groups[item.draw] = group
        if all_infra(group):
          self._requeue(item)
      break
    trajs = [t for item in items for t in groups[item.draw]]
    return [item.task for item in items], trajs

  def _requeue(self, item: WorkItem) -> None:
    again = requeue_or_give_up(item, self.retry)
    if again is None:
      self._counters["given_up"] += 1
    else:
      self._requeued.append(again)
      self._counters["requeued"] += 1

  def metrics(self) -> dict[str, float]:
    """Since the last call: rollout/{engine_errors, retries, requeued, given_up, invalid}."""
    out = {f"rollout/{k}": float(v - self._window[k]) for k, v in self._counters.items()}
    out.update({f"rollout/total/{k}": float(v) for k, v in self._counters.items()})
    self._window = dict(self._counters)
    out.update(episode_metrics(self.episode))  # the episode's own filters (multi-turn)
    out.update(engine_metrics(self.engine))     # e.g. a fleet's servers in service
    return out

  def state(self) -> dict:
    return {"kind": "sync", "next_draw": self._next_draw, "counters": dict(self._counters),
            "requeued": [it.to_dict() for it in self._requeued]}

  def handover(self) -> tuple[int, list[WorkItem]]:
    """(the next draw index, the failed items waiting for a re-run): where another source
    continues this one's draws (rl.mode="auto" turning async)."""
    return self._next_draw, list(self._requeued)

  def restore(self, state: dict) -> None:
    if not check_kind(state, "sync"):
      return
    self._next_draw = int(state["next_draw"])
    self._counters.update(state["counters"])
    self._window = dict(self._counters)
    self._requeued = [WorkItem.from_dict(d) for d in state["requeued"]]
