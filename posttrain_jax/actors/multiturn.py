"""Multi-turn episodes: an environment (envs/env.py) played through any engine, sync or async.

For a batch of work items, G episodes per item start from the same environment state (the
task's seed) and run in lock-step turns: each turn, one `engine.generate` call samples the next
assistant turn of every episode still running (one batched call; the environments' steps of a
turn run concurrently). Per episode and turn:

    prompt ids (Stitcher: the stream so far) -> sampled ids -> tool-call parse (family format)
      -> env.step -> the env's messages -> next prompt ids (verified to extend the stream)

How an episode ends decides its status (ARCHITECTURE.md):
- the environment says done            -> `ok` with the environment's reward;
- a budget runs out (turns, sampled tokens, seconds, tool calls, context length)
                                        -> `timeout`, reward = env.timeout_reward() (0): a
  failure the policy pays for; never dropped ("drop" exists only to reproduce that failure);
- a turn hits the per-turn token limit -> `truncated`, per `rollout.truncation`;
- our side fails (EnvInfraError or any exception from the environment, an aborted or failed
  engine answer)                        -> `infra_error`: no reward, excluded from loss and
  baselines, counted by cause (the whole group failing requeues the task); "zero" scores it 0
  instead, only to reproduce that failure;
- the engine raising                    -> `run` raises: the rollout source retries the batch.
Tool errors (malformed calls included) are the policy's: counted per cause and charged by the
environment's reward.

The seconds an episode is charged against `Budgets.max_seconds` are its own: the time of its
own environment steps plus, per turn, an equal share of the batched generate call,
dt / rows. Not the wall time since it started (the issue's "wall seconds"; a deliberate
departure): in lock-step turns that also holds every other episode's generation and slowest tool
step, so the same policy timed out on 128 episodes a batch and not on 2 (tests/actors/test_multiturn.py)
-- the likely cause, not re-measured, of a held-out eval (twice a training batch) that read
0.25-0.34 where the same model scored 0.93 alone (issue 9). An env step is timed inside its own
task, so the other steps' synchronous work on the event loop is not its time either. The wall
time is still reported (`episode_s`), beside `policy_s`.

Each trajectory is one training sample (an episode whose template broke the prefix has several,
`metrics["sample_index"]` 0, 1, …; baselines count the episode once). The environment's free
text on the episode (`EnvStep.info["feedback"]` of any step, oldest first, joined by newlines)
is every sample's `feedback`, which a self-distillation teacher reads (teacher.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Optional, Sequence

from posttrain_jax.actors.episode import (DemoContext, EngineLimits, EpisodeContext, InvalidTaskError,
                                          WorkItem, register_episode)
from posttrain_jax.actors.rollout import FINISH_STATUS
from posttrain_jax.actors.stitch import STITCH_MODES, Sample, Stitcher
from posttrain_jax.config_io import from_dict
from posttrain_jax.engines.base import PromptTooLongError, SamplingParams
from posttrain_jax.envs.env import Budgets, EnvInfraError, Environment, env_spec
from posttrain_jax.envs.tool_calls import TOOL_FORMATS, parse_turn
from posttrain_jax.types import Source, Status, Trajectory


@dataclasses.dataclass(frozen=True)
class EnvEpisodeConfig:
  """A multi-turn environment episode (`rl.episode="env"`)."""
  env: str = ""                   # registered environment; "" = each task's metadata["env"]
  env_config: Any = None          # that environment's config (a dict of its fields), None = defaults
  budgets: Budgets = Budgets()    # per-episode turns / tokens / seconds / tool calls
  turn_max_tokens: int = 128      # sampled tokens per assistant turn (hitting it = truncated)
  max_context_tokens: int = 1024  # prompt + turn may not exceed this (the engine's room)
  tool_format: str = "hermes"     # tool-call parser (envs/tool_calls.py): the model's format
  stitch: str = "tokens"          # tokens | template (actors/stitch.py)
  infra_scoring: str = "exclude"  # exclude (infra_error) | zero (naive: reward 0; benchmarks only)
  timeouts: str = "score"         # score (failure) | drop (naive: dropped; benchmarks only)

  def __post_init__(self):
    TOOL_FORMATS.get(self.tool_format)
    if self.stitch not in STITCH_MODES:
      raise ValueError(f"EnvEpisodeConfig.stitch={self.stitch!r}; valid: {STITCH_MODES}")
    if self.infra_scoring not in ("exclude", "zero"):
      raise ValueError(f"EnvEpisodeConfig.infra_scoring={self.infra_scoring!r}; valid: exclude, zero")
    if self.timeouts not in ("score", "drop"):
      raise ValueError(f"EnvEpisodeConfig.timeouts={self.timeouts!r}; valid: score, drop")
    if self.turn_max_tokens < 1 or self.max_context_tokens <= self.turn_max_tokens:
      raise ValueError("EnvEpisodeConfig: need 1 ≤ turn_max_tokens < max_context_tokens, got "
                       f"{self.turn_max_tokens} and {self.max_context_tokens}")


@dataclasses.dataclass
class _Run:
  """One episode in progress."""
  item: WorkItem
  index: int                      # j of G
  env: Environment
  stitcher: Stitcher
  chat: list[dict[str, Any]]      # what the template renders (sampled turns as their text)
  messages: list[dict[str, Any]]  # the OpenAI record (parsed tool calls)
  t0: float
  prompt: list[int] = dataclasses.field(default_factory=list)
  turns: int = 0
  sampled: int = 0
  status: Optional[Status] = None
  reward: Optional[float] = None
  ended_by: str = ""
  error: str = ""
  engine_s: float = 0.0           # wall time of the generate calls it was part of
  engine_share_s: float = 0.0     # its share of them: sum of dt / rows
  env_s: float = 0.0              # its own environment steps (reset included)
  feedback: list[str] = dataclasses.field(default_factory=list)  # the env's texts, oldest first

  def end(self, status: Status, reward: Optional[float], why: str, error: str = "") -> None:
    self.status, self.reward, self.ended_by, self.error = status, reward, why, error

  @property
  def policy_s(self) -> float:
    """The seconds charged to the policy (module docstring)."""
    return self.env_s + self.engine_share_s


class EnvEpisode:
  """Runs `EnvEpisodeConfig` episodes through `engine` (see the module docstring)."""

  def __init__(self, cfg: EnvEpisodeConfig, engine, tokenizer, rollout,
               stop_token_ids: Sequence[int]):
    self.cfg, self.engine, self.tokenizer, self.rollout = cfg, engine, tokenizer, rollout
    self.stop_token_ids = tuple(stop_token_ids)
    self.counters = {"episodes": 0, "dropped_timeouts": 0}
    self._window = dict(self.counters)
    self._env_configs: dict[str, Any] = {}  # environment name -> its converted env_config

  def _env(self, task, index: int) -> Environment:
    name = self.cfg.env or task.metadata.get("env", "")
    if not name:
      raise InvalidTaskError(index, f"task {task.id!r} names no environment (metadata['env']) "
                             "and EnvEpisodeConfig.env is empty")
    spec = env_spec(name)
    if name not in self._env_configs:  # converted once per environment, not once per episode
      self._env_configs[name] = (
          self.cfg.env_config if isinstance(self.cfg.env_config, spec.config_cls)
          else from_dict(spec.config_cls, dict(self.cfg.env_config or {}),
                         "config.rl.episode_config.env_config"))
    return spec.build(self._env_configs[name])

  async def run(self, items: Sequence[WorkItem], seed: int) -> list[list[Trajectory]]:
    runs: list[_Run] = []
    try:
      for i, item in enumerate(items):
        for j in range(self.rollout.group_size):
          env = self._env(item.task, i)
          runs.append(_Run(item, j, env, Stitcher(self.tokenizer, _tools(env), self.cfg.stitch,
                                                  self.stop_token_ids), [], [], time.perf_counter()))
      await asyncio.gather(*(self._reset(r) for r in runs))
      bad = [i for i, r in enumerate(runs) if r.status is None and r.turns == 0
             and len(r.prompt) + self.cfg.turn_max_tokens > self.cfg.max_context_tokens]
      if bad:
        first = runs[bad[0]]
        raise InvalidTaskError(list(items).index(first.item),
                               f"task {first.item.task.id!r}: opening prompt of {len(first.prompt)} "
                               f"tokens + turn_max_tokens {self.cfg.turn_max_tokens} > "
                               f"max_context_tokens {self.cfg.max_context_tokens}")
      turn = 0
      while True:
        live = [r for r in runs if r.status is None]
        if not live:
          break
        await self._turn(live, (seed + 100_003 * turn) % (2**31))
        turn += 1
    finally:
      await asyncio.gather(*(r.env.close() for r in runs), return_exceptions=True)
    return [[t for r in runs if r.item is item for t in self._trajectories(r)] for item in items]

  async def _reset(self, run: _Run) -> None:
    t = time.perf_counter()
    try:
      opening = await run.env.reset(run.item.task, int(run.item.task.metadata.get("seed", 0)))
      run.chat, run.messages = list(opening), list(opening)
      run.prompt = run.stitcher.start(run.chat)
    except Exception as e:  # noqa: BLE001 -- the environment's failure is ours
      if not run.stitcher.samples:
        run.stitcher.samples.append(Sample())
      self._infra(run, e)
    run.env_s += time.perf_counter() - t

  def _infra(self, run: _Run, e: BaseException) -> None:
    cause = e.cause if isinstance(e, EnvInfraError) else type(e).__name__
    if self.cfg.infra_scoring == "zero":
      run.end(Status.OK, 0.0, f"infra/{cause}", f"{type(e).__name__}: {e}")
    else:
      run.end(Status.INFRA_ERROR, None, f"infra/{cause}", f"{type(e).__name__}: {e}")

  def _timeout(self, run: _Run, why: str) -> None:
    run.end(Status.TIMEOUT, run.env.timeout_reward(), f"timeout/{why}")

  async def _turn(self, live: list[_Run], seed: int) -> None:
    b = self.cfg.budgets
    asked = []
    for r in live:
      if r.policy_s >= b.max_seconds:
        self._timeout(r, "seconds")
      elif len(r.prompt) + self.cfg.turn_max_tokens > self.cfg.max_context_tokens:
        self._timeout(r, "context")
      else:
        asked.append(r)
    if not asked:
      return
    sp = SamplingParams(max_tokens=self.cfg.turn_max_tokens, temperature=self.rollout.temperature,
                        top_p=self.rollout.top_p, top_k=self.rollout.top_k,
                        stop_token_ids=self.stop_token_ids)
    t = time.perf_counter()
    try:
      out = await asyncio.to_thread(self.engine.generate, [r.prompt for r in asked], sp, 1, seed)
    except PromptTooLongError as e:  # the engine's room is smaller than max_context_tokens
      self._timeout(asked[e.index], "context")
      return
    dt = time.perf_counter() - t
    steps = []
    for r, comps in zip(asked, out):
      r.engine_s += dt
      r.engine_share_s += dt / len(asked)
      steps.append(self._after_sample(r, comps[0]))
    await asyncio.gather(*(s for s in steps if s is not None))

  def _after_sample(self, r: _Run, comp):
    """Records the sampled turn; returns the env step coroutine, or None if the episode ended."""
    b = self.cfg.budgets
    status = FINISH_STATUS.get(comp.finish_reason)
    if status is None or status is Status.INFRA_ERROR:
      r.end(Status.INFRA_ERROR, None, f"infra/{comp.finish_reason}",
            f"engine finish_reason {comp.finish_reason!r}")
      return None
    ids, lps = list(comp.token_ids), list(comp.logprobs)
    over = r.sampled + len(ids) - b.max_tokens
    if over > 0:  # the episode's token budget ends inside this turn: keep what fit
      ids, lps = ids[:len(ids) - over], lps[:len(lps) - over]
    text = r.stitcher.sampled(ids, lps, comp.version)
    r.sampled += len(ids)
    r.turns += 1
    parsed = parse_turn(text, self.cfg.tool_format, turn=r.turns - 1)
    r.chat.append({"role": "assistant", "content": text})
    r.messages.append(parsed.message())
    if over > 0:
      self._timeout(r, "tokens")
      return None
    if status is Status.TRUNCATED:
      return self._truncated(r, parsed)
    return self._step(r, parsed)

  async def _truncated(self, r: _Run, parsed) -> None:
    policy = self.rollout.truncation
    reward = 0.0
    if policy != "penalise":
      try:
        reward = await r.env.score_truncated(parsed)
      except Exception as e:  # noqa: BLE001 -- a grader failure is ours
        self._infra(r, e)
        return
    r.end(Status.TRUNCATED, reward, f"truncated/{policy}")

  async def _step(self, r: _Run, parsed) -> None:
    b = self.cfg.budgets
    left = b.max_seconds - r.policy_s

    async def timed():  # timed inside its own task: not the wait for the turn's other steps
      t = time.perf_counter()
      try:
        return await r.env.step(parsed)
      finally:
        r.env_s += time.perf_counter() - t
    try:
      step = await asyncio.wait_for(timed(), timeout=max(left, 1e-3))
    except asyncio.TimeoutError:
      self._timeout(r, "seconds")
      return
    except Exception as e:  # noqa: BLE001 -- the environment's failure is ours
      self._infra(r, e)
      return
    r.chat += step.messages
    r.messages += step.messages
    if isinstance(step.info.get("feedback"), str) and step.info["feedback"]:
      r.feedback.append(step.info["feedback"])
    calls = getattr(r.env, "counts", {}).get("tool_calls", 0)
    if step.done:
      r.end(Status.OK, step.reward, step.info.get("ended_by", "done"))
    elif calls > b.max_tool_calls:
      self._timeout(r, "tool_calls")
    elif r.turns >= b.max_turns:
      self._timeout(r, "turns")
    elif r.sampled >= b.max_tokens:
      self._timeout(r, "tokens")
    else:
      r.prompt = r.stitcher.extend(r.chat)

  def metrics(self) -> dict[str, float]:
    """Since the last call: `filter/dropped_timeout_frac`, the episodes `timeouts="drop"` took
    out (0 by default): a filter is never invisible, even the naive one."""
    d = {k: v - self._window[k] for k, v in self.counters.items()}
    self._window = dict(self.counters)
    return {"filter/dropped_timeout_frac": d["dropped_timeouts"] / d["episodes"]
            if d["episodes"] else 0.0}

  def _trajectories(self, r: _Run) -> list[Trajectory]:
    self.counters["episodes"] += 1
    if r.status is Status.TIMEOUT and self.cfg.timeouts == "drop":
      self.counters["dropped_timeouts"] += 1
      return []
    counts = dict(getattr(r.env, "counts", {}))
    task = r.item.task
    metrics: dict[str, Any] = {
        "turns": float(r.turns), "response_len": float(r.sampled), "draw": r.item.draw,
        "requeues": r.item.requeues, "ended_by": r.ended_by, "engine_s": r.engine_s,
        "env_s": r.env_s, "policy_s": r.policy_s, "episode_s": time.perf_counter() - r.t0,
        "tool_calls": float(counts.pop("tool_calls", 0)),
        **{f"tool_errors/{k}": float(v) for k, v in counts.items()},
        **{f"stitch_breaks/{k}": float(v) for k, v in r.stitcher.breaks.items()},
    }
    if "difficulty" in task.metadata:
      metrics["difficulty"] = str(task.metadata["difficulty"])
    if r.status is Status.INFRA_ERROR:
      metrics.update({"infra_error": 1.0, "error": r.error, r.ended_by: 1.0})
    out = []
    samples = r.stitcher.samples
    for k, s in enumerate(samples):
      s = s.through_last_sampled()  # glue after the last turn (a final tool result) trains nothing
      mask = s.loss_mask
      if r.status is Status.TRUNCATED and self.rollout.truncation == "mask":
        mask = [0] * len(mask)
      out.append(Trajectory(
          id=f"{r.item.group_id}/{r.index}" + (f".{k}" if len(samples) > 1 else ""),
          task_id=task.id, group_id=r.item.group_id, source=Source.ENV,
          token_ids=list(s.token_ids), loss_mask=list(mask),
          behaviour_logprobs=list(s.logprobs), policy_version=list(s.versions),
          messages=r.messages if k == len(samples) - 1 else [], tools=r.stitcher.tools,
          reward=r.reward, status=r.status, feedback="\n".join(r.feedback) or None,
          metrics={**metrics, "sample_index": k, "samples": len(samples),
                   "episode_id": f"{r.item.group_id}/{r.index}"}))
    return out


def _tools(env: Environment) -> Optional[list[dict[str, Any]]]:
  return [t.to_openai() for t in env.tools] or None


def _evaluate(episode: "EnvEpisode", tasks, temperature: float, n: int, max_tokens: int,
              seed: int) -> dict[str, float]:
  """Whole episodes on the held-out tasks (their turns take `turn_max_tokens` each)."""
  del max_tokens
  d = evaluate_episodes_detail(episode, tasks, temperature, n, seed)
  return {"accuracy": d["accuracy"], "count": float(len(tasks)),
          "timeout_frac": d["timeout_frac"], "infra_error_frac": d["infra_error_frac"]}


def _demonstration(cfg: "EnvEpisodeConfig", demo: DemoContext, task, tid: str) -> Trajectory:
  return demonstration_trajectory(demo.tokenizer, task, cfg, demo.stop_token_ids, tid)


def _limits(cfg: "EnvEpisodeConfig", rollout, eval_max_tokens: int,
            longest_prompt) -> EngineLimits:
  """A turn's prompt is the whole context so far: up to max_context_tokens less a turn."""
  del rollout, eval_max_tokens, longest_prompt
  return EngineLimits(cfg.max_context_tokens - cfg.turn_max_tokens, cfg.turn_max_tokens,
                      cfg.turn_max_tokens)


@register_episode("env", EnvEpisodeConfig, evaluate=_evaluate, demonstration=_demonstration,
                  limits=_limits)
def _build(cfg: EnvEpisodeConfig, ctx: EpisodeContext) -> EnvEpisode:
  return EnvEpisode(cfg, ctx.engine, ctx.tokenizer, ctx.rollout, ctx.stop_token_ids)


def demonstration_trajectory(tokenizer, task, cfg: EnvEpisodeConfig,
                             stop_token_ids: Sequence[int], tid: str) -> Trajectory:
  """A supervised multi-turn example: the environment's gold chat for `task`, stitched like an
  episode (assistant turns + their stop token have loss mask 1, everything else 0)."""
  name = cfg.env or task.metadata.get("env", "")
  spec = env_spec(name)
  if spec.demonstration is None:
    raise InvalidTaskError(0, f"environment {name!r} has no demonstrations for SFT "
                           "(register_env(..., demonstration=)); set sft.steps=0")
  chat = spec.demonstration(task, cfg.tool_format)
  env = spec.build(spec.config_cls())
  st = Stitcher(tokenizer, _tools(env), "tokens", stop_token_ids)
  turns = [i for i, m in enumerate(chat) if m["role"] == "assistant"]
  st.start(chat[:turns[0]])
  for k, i in enumerate(turns):
    ids = st.encode(chat[i]["content"]) + [int(stop_token_ids[0])]
    st.sampled(ids, [0.0] * len(ids), version=0)
    if k + 1 < len(turns):
      st.extend(chat[:turns[k + 1]])
  if len(st.samples) != 1:
    raise ValueError(f"the demonstration of task {task.id!r} does not stitch into one sample "
                     f"(breaks: {dict(st.breaks)})")
  s = st.samples[0]
  return Trajectory(id=tid, task_id=task.id, token_ids=s.token_ids, loss_mask=s.loss_mask,
                    behaviour_logprobs=[0.0] * len(s.token_ids),
                    policy_version=[-1] * len(s.token_ids), source=Source.ENV)


def evaluate_episodes(episode: "EnvEpisode", tasks, temperature: float, n: int,
                      seed: int) -> float:
  """Mean reward of `n` episodes per held-out task at `temperature` (`evaluate_episodes_detail`)."""
  return evaluate_episodes_detail(episode, tasks, temperature, n, seed)["accuracy"]


def evaluate_episodes_detail(episode: "EnvEpisode", tasks, temperature: float, n: int,
                             seed: int) -> dict[str, float]:
  """`accuracy`: the mean reward of `n` episodes per held-out task at `temperature`, whatever
  the training scoring: infra errors are left out (`infra_scoring="zero"`, the naive benchmark
  setting, would make it measure the tool backend's faults) and timeouts are failures
  (`timeouts="drop"` would hide exactly the timeouts a policy learns to reach). Beside it the
  episodes' fates, so an eval that reads low says why: `timeout_frac` and `infra_error_frac`
  (of all episodes) and `episodes`."""
  rollout = dataclasses.replace(episode.rollout, group_size=n, temperature=temperature)
  cfg = dataclasses.replace(episode.cfg, infra_scoring="exclude", timeouts="score")
  ev = EnvEpisode(cfg, episode.engine, episode.tokenizer, rollout, episode.stop_token_ids)
  groups = asyncio.run(ev.run([WorkItem(-1 - i, t) for i, t in enumerate(tasks)], seed))
  firsts = [t for g in groups for t in g if t.metrics.get("sample_index", 0) == 0]
  rewards = [t.reward for t in firsts if t.status is not Status.INFRA_ERROR]
  total = len(firsts) or 1
  return {"accuracy": sum(rewards) / len(rewards) if rewards else float("nan"),
          "timeout_frac": sum(t.status is Status.TIMEOUT for t in firsts) / total,
          "infra_error_frac": sum(t.status is Status.INFRA_ERROR for t in firsts) / total,
          "episodes": float(len(firsts))}
