"""The fidelity environments' demonstrations: each path is the chat it claims (checked by
replaying it through the environment), the paths mix as documented, and, played by a scripted
engine under the benchmark's own budgets (benchmarks/fidelity.py's CASES), each ends as the
benchmark needs: a think is a timeout, a verify makes 4 tool calls, the rest end ok."""
import asyncio
import collections
import functools
import importlib.util
import pathlib

import numpy as np
import pytest

from posttrain_jax.actors.episode import WorkItem
from posttrain_jax.actors.multiturn import EnvEpisode, EnvEpisodeConfig, demonstration_trajectory
from posttrain_jax.actors.rollout import RolloutConfig
from posttrain_jax.config_io import from_dict
from posttrain_jax.envs import fidelity_envs
from posttrain_jax.envs.env import EnvInfraError, env_spec
from posttrain_jax.envs.tool_calls import ToolCall, parse_turn, render_call
from posttrain_jax.envs.tool_math import ToolMathTasks, demonstration as tool_math_demo, draw_tool_math
from posttrain_jax.types import Status
from tests.support import envs as et

INFRA, TIMEOUT = "tool_math_fidelity_infra", "tool_math_fidelity_timeout"
PATHS = {INFRA: {"tool", "verify"}, TIMEOUT: {"tool", "think", "direct"}}


@functools.lru_cache(maxsize=None)
def _benchmark_cases():
  path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "fidelity.py"
  spec = importlib.util.spec_from_file_location("fidelity_benchmark", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return {c["env"]: c for c in mod.CASES.values()}


@functools.lru_cache(maxsize=None)
def _tasks(n):
  rng = np.random.default_rng(0)
  cfg = ToolMathTasks(min_digits=4, max_digits=4, ops="*", hard_fraction=1.0, hard_digits=4)
  return tuple(draw_tool_math(cfg, rng)[1] for _ in range(n))


def _by_path(env):
  out = {}
  for t in _tasks(800):  # enough for a path of 1 slot in 64
    out.setdefault(fidelity_envs.demonstration_path(env, t), t)
  assert set(out) == PATHS[env], out
  return out


def _demo(env, task):
  return env_spec(env).demonstration(task, "hermes")


def _replay(env, task):
  """Plays the demonstration's assistant turns through the environment: (done, reward, calls)."""
  e = env_spec(env).build(env_spec(env).config_cls())

  async def go():
    await e.reset(task, 0)
    step = None
    try:
      for k, m in enumerate(m for m in _demo(env, task) if m["role"] == "assistant"):
        step = await e.step(parse_turn(m["content"], "hermes", turn=k))
        if step.done:
          break
    finally:
      await e.close()
    return step.done, step.reward, e.counts["tool_calls"]
  return asyncio.run(go())


def test_paths_mix_as_documented():
  tasks = _tasks(800)
  for env, slots in fidelity_envs.SLOTS.items():
    seen = collections.Counter(fidelity_envs.demonstration_path(env, t) for t in tasks)
    assert set(seen) == PATHS[env], (env, seen)
    for path in seen:  # crc32 of the task ids spreads them over the slots evenly
      want = slots.count(path) / len(slots)
      assert abs(seen[path] / len(tasks) - want) < 0.04 + want / 4, (env, path, seen)


@pytest.mark.parametrize("env", [INFRA, TIMEOUT])
def test_each_path_plays_as_claimed_in_the_environment(env):
  for path, task in _by_path(env).items():
    chat = _demo(env, task)
    done, reward, calls = _replay(env, task)
    assert done
    if path == "think":  # ends without an answer: wrong, unless the budget ends it first
      assert reward == 0.0 and calls == 0 and len(chat) == 2
      assert "answer" not in chat[-1]["content"]
      continue
    assert reward == 1.0, (path, chat)
    if env == INFRA:  # python, the checks, submit: the answer is never written out
      assert calls == {"tool": 2, "verify": 2 + fidelity_envs.VERIFY_RERUNS}[path]
      assert "submit" in chat[-1]["content"] and task.answer not in chat[-1]["content"]
    else:
      assert calls == {"tool": 1, "direct": 0}[path]
      assert chat[-1] == {"role": "assistant", "content": f"The answer is {task.answer}."}


@pytest.mark.parametrize("env", [INFRA, TIMEOUT])
def test_demonstrations_stitch_into_one_sample(env):
  tok = et.tokenizer("hermes")
  stop = et.stop_ids(tok, "hermes")
  for path, task in _by_path(env).items():
    traj = demonstration_trajectory(tok, task, EnvEpisodeConfig(env=env), stop, f"d-{path}")
    n_turns = sum(m["role"] == "assistant" for m in _demo(env, task))
    # each assistant turn is one masked-in run ending in the stop token
    runs = sum(1 for a, b in zip([0] + traj.loss_mask, traj.loss_mask) if b and not a)
    assert runs == n_turns
    assert tok.decode([t for t, m in zip(traj.token_ids, traj.loss_mask) if m]).count(
        "The answer is") == (0 if path == "think" or env == INFRA else 1)


def test_paths_differ_from_the_first_sampled_token():
  """Case 2's premise: the three paths are one decision at the first sampled token."""
  tok = et.tokenizer("hermes")
  first = {}
  for path, task in _by_path(TIMEOUT).items():
    turn = next(m["content"] for m in _demo(TIMEOUT, task) if m["role"] == "assistant")
    first[path] = tok(turn, add_special_tokens=False)["input_ids"][0]
  assert len(set(first.values())) == 3, first


def test_tool_math_demonstrations_are_unchanged():
  for task in _tasks(8):
    chat = tool_math_demo(task, "hermes")
    assert [m["role"] for m in chat] == ["user", "assistant", "tool", "assistant"]
    assert env_spec("tool_math").demonstration is tool_math_demo


def _play(env, task, **naive):
  """The demonstration's assistant turns sampled by a scripted engine in a real EnvEpisode with
  the benchmark's budgets for `env`; `naive` overrides its scoring."""
  case = _benchmark_cases()[env]
  tok = et.tokenizer("hermes")
  stops = et.stop_ids(tok, "hermes")
  turns = [m["content"] for m in _demo(env, task) if m["role"] == "assistant"]
  cfg = from_dict(EnvEpisodeConfig, {"env": env, "turn_max_tokens": case["turn_max_tokens"],
                                     "max_context_tokens": case["seq_len"], "budgets": case["budgets"],
                                     **naive}, "episode")
  engine = et.ScriptedEngine(tok, lambda _, k: turns[k], stops[0])
  ep = EnvEpisode(cfg, engine, tok, RolloutConfig(group_size=1), stops)
  return asyncio.run(ep.run([WorkItem(0, task)], seed=0))[0]


def test_think_times_out_under_the_benchmark_budget_and_drop_hides_it():
  """A think runs past case 2's token budget: a timeout (reward 0) under "score", no trajectory
  under "drop"; tool and direct fit in it and end ok with reward 1 either way."""
  by_path = _by_path(TIMEOUT)
  (think,) = _play(TIMEOUT, by_path["think"], timeouts="score")
  assert think.status is Status.TIMEOUT and think.reward == 0.0
  assert think.metrics["ended_by"] == "timeout/tokens"
  assert _play(TIMEOUT, by_path["think"], timeouts="drop") == []
  for path in ("tool", "direct"):
    for timeouts in ("score", "drop"):
      (t,) = _play(TIMEOUT, by_path[path], timeouts=timeouts)
      assert t.status is Status.OK and t.reward == 1.0, (path, timeouts)


def test_verify_fits_the_benchmark_budget():
  """Case 1's long path and short path both end ok (by submit) inside its budget, the long one
  with VERIFY_RERUNS more tool calls and more than twice the sampled tokens."""
  by_path = _by_path(INFRA)
  (tool,) = _play(INFRA, by_path["tool"])
  (verify,) = _play(INFRA, by_path["verify"])
  for t in (tool, verify):
    assert t.status is Status.OK and t.reward == 1.0 and t.metrics["ended_by"] == "submit"
  assert (tool.metrics["tool_calls"], verify.metrics["tool_calls"]) == (
      2.0, 2.0 + fidelity_envs.VERIFY_RERUNS)
  assert verify.metrics["response_len"] > 2 * tool.metrics["response_len"]


def test_check_replays_the_last_outcome_on_the_faulty_backend(monkeypatch):
  """check() returns what the last python program printed (or its error again: the policy's),
  is the policy's error before any program ran, meets the injected backend faults like python
  does, and starts no sandbox process of its own (only the python calls do)."""
  from posttrain_jax.sandbox.session import SandboxSession
  started = []
  real_arun = SandboxSession.arun

  async def counting_arun(self, argv, *a, **k):
    started.append(argv)
    return await real_arun(self, argv, *a, **k)
  monkeypatch.setattr(SandboxSession, "arun", counting_arun)
  spec = env_spec(INFRA)
  task = _tasks(1)[0]

  async def calls(env, *codes):
    await env.reset(task, 0)
    out = []
    try:
      for k, code in enumerate(codes):
        call = ToolCall("check", {}) if code is None else ToolCall("python", {"code": code})
        step = await env.step(parse_turn(render_call(call, "hermes"), "hermes", turn=k))
        out.append(step.messages[-1]["content"])
    finally:
      await env.close()
    return out, dict(env.counts)

  out, counts = asyncio.run(calls(spec.build(spec.config_cls()), None, "print(6*7)", None, None))
  assert out[0].startswith("error: check: no python program") and counts["tool_failed"] == 1
  n = fidelity_envs.VERIFY_RERUNS
  assert out[1:] == ["42", f"42 (run 1 of {n})", f"42 (run 2 of {n})"]
  assert len(started) == 1  # the python call's process; the checks reached no new one
  out, counts = asyncio.run(calls(spec.build(spec.config_cls()), "print(1//0)", None, None))
  assert all("ZeroDivisionError" in o for o in out) and counts["tool_failed"] == 3, (out, counts)
  assert len(started) == 2
  faulty = spec.build(spec.config_cls(infra_fault_rate=0.5))
  faulty._faults.random = iter([0.9, 0.1]).__next__  # python's draw passes, check's faults
  with pytest.raises(EnvInfraError, match="injected"):
    asyncio.run(calls(faulty, "print(6*7)", None))


def test_submit_grades_what_the_last_program_printed():
  spec = env_spec(INFRA)
  task = _tasks(1)[0]
  a, b = task.metadata["expression"].split("*")

  async def episode(*turns):
    env = spec.build(spec.config_cls())
    await env.reset(task, 0)
    try:
      for k, t in enumerate(turns):
        step = await env.step(parse_turn(t, "hermes", turn=k))
    finally:
      await env.close()
    return step
  py = lambda code: render_call(ToolCall("python", {"code": code}), "hermes")  # noqa: E731
  submit = render_call(ToolCall("submit", {}), "hermes")
  right = asyncio.run(episode(py(f"print({a}*{b})"), submit))
  assert right.done and right.reward == 1.0 and right.info["ended_by"] == "submit"
  wrong = asyncio.run(episode(py(f"print({a}*{b} + 1)"), submit))
  assert wrong.done and wrong.reward == 0.0
  assert asyncio.run(episode(submit)).reward == 0.0  # nothing printed yet
  both = asyncio.run(episode(py(f"print({a}*{b})") + "\n" + submit))  # submit beside a call
  assert not both.done and "call it alone" in both.messages[-1]["content"]
