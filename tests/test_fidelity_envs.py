"""tool_math_fidelity's demonstrations: each path is the chat it claims (checked by replaying it
through the environment), the paths mix as documented, and tool_math itself is unchanged."""
import asyncio
import collections

import numpy as np

from posttrain_jax.actors.episode import WorkItem
from posttrain_jax.actors.multiturn import EnvEpisode, EnvEpisodeConfig, demonstration_trajectory
from posttrain_jax.actors.rollout import RolloutConfig
from posttrain_jax.envs import fidelity_envs
from posttrain_jax.envs.env import env_spec
from posttrain_jax.envs.tool_calls import parse_turn
from posttrain_jax.envs.env import Budgets
from posttrain_jax.envs.tool_math import ToolMathTasks, demonstration as tool_math_demo, draw_tool_math
from posttrain_jax.types import Status
from tests import envs_testing as et


def _tasks(n, **cfg):
  rng = np.random.default_rng(0)
  return [draw_tool_math(ToolMathTasks(**cfg), rng)[1] for _ in range(n)]


def _replay(task, chat):
  """Plays the demonstration's assistant turns through the environment: (done, reward, calls)."""
  env = env_spec("tool_math_fidelity").build(env_spec("tool_math_fidelity").config_cls())

  async def go():
    await env.reset(task, 0)
    step = None
    try:
      for k, m in enumerate(m for m in chat if m["role"] == "assistant"):
        step = await env.step(parse_turn(m["content"], "hermes", turn=k))
        if step.done:
          break
    finally:
      await env.close()
    return (step.done, step.reward, env.counts["tool_calls"])
  return asyncio.run(go())


def test_paths_mix_as_documented():
  easy = collections.Counter(map(fidelity_envs.demonstration_path,
                                 _tasks(400, min_digits=1, max_digits=1, ops="+")))
  hard = collections.Counter(map(fidelity_envs.demonstration_path,
                                 _tasks(400, min_digits=1, max_digits=1, ops="*",
                                        hard_fraction=1.0, hard_digits=2)))
  assert set(easy) == {"tool", "direct"} and abs(easy["tool"] / 400 - 0.5) < 0.1, easy
  assert set(hard) == {"tool", "direct", "stall"}, hard
  assert abs(hard["stall"] / 400 - 0.25) < 0.08 and abs(hard["direct"] / 400 - 0.5) < 0.1, hard


def test_each_path_plays_as_claimed_in_the_environment():
  tasks = _tasks(40, min_digits=1, max_digits=1, ops="*", hard_fraction=0.5, hard_digits=2)
  seen = set()
  for task in tasks:
    path = fidelity_envs.demonstration_path(task)
    chat = fidelity_envs.demonstration(task, "hermes")
    done, reward, calls = _replay(task, chat)
    seen.add(path)
    if path == "stall":  # never answers: only the budget ends it
      assert not done and calls == fidelity_envs.STALL_CALLS
      assert chat[-1]["role"] == "tool"
    else:
      assert done and reward == 1.0, (path, chat)
      assert calls == (1 if path == "tool" else 0)
      assert chat[-1] == {"role": "assistant", "content": f"The answer is {task.answer}."}
  assert seen == {"tool", "direct", "stall"}


def test_demonstrations_stitch_into_one_sample():
  tok = et.tokenizer("hermes")
  stop = et.stop_ids(tok, "hermes")
  cfg = EnvEpisodeConfig(env="tool_math_fidelity")
  for i, task in enumerate(_tasks(12, min_digits=1, max_digits=1, ops="*", hard_fraction=0.5,
                                  hard_digits=2)):
    traj = demonstration_trajectory(tok, task, cfg, stop, f"d{i}")
    n_turns = sum(m["role"] == "assistant" for m in fidelity_envs.demonstration(task, "hermes"))
    # each assistant turn is one masked-in run ending in the stop token
    runs = sum(1 for a, b in zip([0] + traj.loss_mask, traj.loss_mask) if b and not a)
    assert runs == n_turns
    assert tok.decode([t for t, m in zip(traj.token_ids, traj.loss_mask) if m]).count(
        "The answer is") == (0 if fidelity_envs.demonstration_path(task) == "stall" else 1)


def test_tool_math_demonstrations_are_unchanged():
  for task in _tasks(8):
    chat = tool_math_demo(task, "hermes")
    assert [m["role"] for m in chat] == ["user", "assistant", "tool", "assistant"]
    assert env_spec("tool_math").demonstration is tool_math_demo


def _play_episode(task, timeouts):
  """The demonstration's assistant turns sampled by a scripted engine in a real EnvEpisode."""
  tok = et.tokenizer("hermes")
  stops = et.stop_ids(tok, "hermes")
  turns = [m["content"] for m in fidelity_envs.demonstration(task, "hermes")
           if m["role"] == "assistant"]
  engine = et.ScriptedEngine(tok, lambda _, k: turns[k], stops[0])
  ep = EnvEpisode(EnvEpisodeConfig(env="tool_math_fidelity", turn_max_tokens=40,
                                   max_context_tokens=352, timeouts=timeouts,
                                   budgets=Budgets(max_turns=3, max_tool_calls=3)),
                  engine, tok, RolloutConfig(group_size=1), stops)
  return asyncio.run(ep.run([WorkItem(0, task)], seed=0))[0]


def test_stall_times_out_and_drop_hides_it():
  """With the benchmark's budget a stall is a timeout (reward 0) under "score" and leaves no
  trajectory under "drop"; the tool and direct paths end ok with reward 1 either way."""
  tasks = _tasks(40, min_digits=1, max_digits=1, ops="*", hard_fraction=1.0, hard_digits=2)
  by_path = {fidelity_envs.demonstration_path(t): t for t in tasks}
  assert set(by_path) == {"tool", "direct", "stall"}
  (stall,) = _play_episode(by_path["stall"], "score")
  assert stall.status is Status.TIMEOUT and stall.reward == 0.0
  assert stall.metrics["ended_by"] == "timeout/turns"
  assert _play_episode(by_path["stall"], "drop") == []
  for path in ("tool", "direct"):
    for timeouts in ("score", "drop"):
      (t,) = _play_episode(by_path[path], timeouts)
      assert t.status is Status.OK and t.reward == 1.0, (path, timeouts)
