"""Multi-turn episodes: token-exact stitching on every chat format, breaks counted by reason,
and the status semantics (timeouts scored, infra errors excluded, malformed calls charged)."""
import asyncio
import time

import pytest

from posttrain_jax.actors.episode import WorkItem
from posttrain_jax.actors.multiturn import (EnvEpisode, EnvEpisodeConfig, evaluate_episodes,
                                            evaluate_episodes_detail)
from posttrain_jax.actors.rollout import RolloutConfig
from posttrain_jax.envs.env import Budgets, EnvInfraError, ToolEnvConfig
from posttrain_jax.types import Status
from tests.support import envs as et
from tests.support.envs import CALL, run_episode, tool_then_answer

FORMATS = [("chatml", "hermes"), ("hermes", "hermes"), ("hermes_thinking", "hermes"),
           ("llama3", "llama3_json")]






def check_exact(tok, engine, sample_trajs):
  """Every prompt the engine got is a prefix of the sample, the ids it returned follow it with
  mask 1 and their log-probs, and nothing else carries mask 1."""
  assert len(sample_trajs) == 1
  t = sample_trajs[0]
  marked = [0] * len(t.token_ids)
  for prompt, ret in zip(engine.prompts, engine.returned):
    n = len(prompt)
    assert t.token_ids[:n] == prompt
    assert t.token_ids[n:n + len(ret)] == ret
    assert t.loss_mask[n:n + len(ret)] == [1] * len(ret)
    for i in range(n, n + len(ret)):
      marked[i] = 1
  assert t.loss_mask == marked
  assert sum(t.loss_mask) == sum(len(r) for r in engine.returned)
  assert all(v == 0 for v, m in zip(t.policy_version, t.loss_mask) if m)
  assert all(v == -1 for v, m in zip(t.policy_version, t.loss_mask) if not m)


@pytest.mark.parametrize("chat_format,tool_format", FORMATS, ids=[f for f, _ in FORMATS])
def test_sample_is_exactly_the_sampled_tokens_plus_what_the_env_appended(chat_format,
                                                                         tool_format):
  if chat_format == "chatml":  # no tools in this format: an answer, a follow-up, an answer
    script = lambda p, k: "It is 5." if k == 0 else "Yes, 5."  # noqa: E731
    env_cfg = dict(follow_up=True)
  else:
    script, env_cfg = tool_then_answer(tool_format), None
  tok, engine, ep, groups = run_episode(chat_format, tool_format, script, env_config=env_cfg)
  (t,) = groups[0]
  assert t.status is Status.OK and t.reward == 1.0 and t.metrics["turns"] == 2.0
  check_exact(tok, engine, groups[0])
  # independent of the stitcher: the template's rendering of the chat (the record's messages,
  # assistant turns as the texts the policy wrote) is the sample's text, up to the end-of-turn
  # glue after the last sampled stop token
  texts = iter(engine.texts)
  chat = [{"role": "assistant", "content": next(texts)} if m["role"] == "assistant" else m
          for m in t.messages]
  rendered = tok.apply_chat_template(chat, tools=_tools(chat_format), tokenize=False)
  text = tok.decode(t.token_ids, skip_special_tokens=False)
  assert rendered.startswith(text) and rendered[len(text):] in ("", "\n")
  # what the environment appended is in the glue, nowhere in the sampled part
  glue = tok.decode([i for i, m in zip(t.token_ids, t.loss_mask) if not m],
                    skip_special_tokens=False)
  sampled = tok.decode([i for i, m in zip(t.token_ids, t.loss_mask) if m],
                       skip_special_tokens=False)
  appended = {"chatml": "Are you sure?", "llama3": "ipython<|end_header_id|>\n\n5<|eot_id|>"}.get(
      chat_format, "<tool_response>\n5\n</tool_response>")
  assert appended in glue and appended not in sampled
  assert not any(k.startswith("stitch_breaks/") for k in t.metrics)


def _tools(chat_format):
  if chat_format == "chatml":
    return None
  return [s.to_openai() for s in et.CalcEnv.tools]


def test_a_template_that_edits_history_starts_a_new_sample_and_counts_the_break():
  """hermes_thinking drops <think> from assistant turns before the last user message (like
  Qwen3): after the follow-up question the stream no longer extends, a second sample starts."""
  def script(prompt, k):
    return ['<think>use add</think>' + CALL["hermes"], "<think>got it</think>It is 5.",
            "Yes, 5."][k]
  tok, engine, ep, groups = run_episode("hermes_thinking", "hermes", script,
                                        env_config=dict(follow_up=True))
  first, second = groups[0]
  assert first.metrics["stitch_breaks/thinking_stripped"] == 1.0
  assert [first.metrics["sample_index"], second.metrics["sample_index"]] == [0, 1]
  assert first.reward == second.reward == 1.0 and first.status is second.status is Status.OK
  # each sample is exact on its own: turns 0-1 in the first, turn 2 in the second
  prompts, returned = engine.prompts, engine.returned
  for t, turns in ((first, [0, 1]), (second, [2])):
    marked = [0] * len(t.token_ids)
    for k in turns:
      n = len(prompts[k])
      assert t.token_ids[:n] == prompts[k] and t.token_ids[n:n + len(returned[k])] == returned[k]
      marked[n:n + len(returned[k])] = [1] * len(returned[k])
    assert t.loss_mask == marked
  # the second sample starts from the template's rendering, thinking of the old turns gone
  assert "use add" not in tok.decode(second.token_ids) and "use add" in tok.decode(first.token_ids)
  # the same episode on the template that keeps history: one sample, no break
  _, _, _, same = run_episode("hermes", "hermes", script, env_config=dict(follow_up=True))
  assert len(same[0]) == 1 and "stitch_breaks/thinking_stripped" not in same[0][0].metrics


def test_non_canonical_sampled_ids_stay_exact_and_template_mode_counts_them():
  """A policy that samples 'add' as a+d+d: the token stream keeps those ids ("tokens"); a
  re-tokenising chat server would not ("template" counts a retokenized break)."""
  script = tool_then_answer("hermes")
  tok, engine, _, groups = run_episode("hermes", "hermes", script, split="bytes")
  assert engine.returned[0] != list(tok(engine.texts[0], add_special_tokens=False)["input_ids"])
  check_exact(tok, engine, groups[0])
  _, engine, _, groups = run_episode("hermes", "hermes", script, split="bytes",
                                     stitch="template")
  assert groups[0][0].metrics["stitch_breaks/retokenized"] == 1.0 and len(groups[0]) == 2


def test_malformed_call_costs_the_policy():
  def script(prompt, k):
    return '<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call>' if k == 0 else "5"
  _, engine, _, groups = run_episode("hermes", "hermes", script)
  (t,) = groups[0]
  assert t.metrics["tool_errors/malformed"] == 1.0 and t.metrics["tool_calls"] == 1.0
  assert t.reward == pytest.approx(0.9) and t.status is Status.OK    # 1 − malformed_penalty
  assert "malformed tool call (invalid_json)" in t.messages[3]["content"]
  ended = run_episode("hermes", "hermes", script,
                      env_config=dict(tool=ToolEnvConfig(on_malformed="end")))[3]
  assert ended[0][0].reward == 0.0 and ended[0][0].metrics["turns"] == 1.0


def test_unknown_tool_and_bad_arguments_are_tool_errors():
  def script(prompt, k):
    return ['<tool_call>{"name": "mul", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "add", "arguments": {"a": "2", "b": 3}}</tool_call>',
            '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>', "5"][k]
  _, _, _, groups = run_episode("hermes", "hermes", script)
  m = groups[0][0].metrics
  assert (m["tool_errors/unknown_tool"], m["tool_errors/bad_arguments"]) == (1.0, 2.0)
  msgs = [x["content"] for x in groups[0][0].messages if x["role"] == "tool"]
  assert "unknown tool 'mul'" in msgs[0] and "'a' must be a integer" in msgs[1]
  assert "missing ['b']" in msgs[2]


@pytest.mark.parametrize("budget,why", [
    (dict(max_turns=3), "turns"), (dict(max_tool_calls=2), "tool_calls"),
    (dict(max_tokens=60), "tokens")])
def test_an_exhausted_budget_is_a_scored_timeout(budget, why):
  always_call = lambda p, k: CALL["hermes"]  # noqa: E731 -- never answers
  _, engine, ep, groups = run_episode("hermes", "hermes", always_call,
                                      budgets=Budgets(**budget), group_size=2)
  assert len(groups[0]) == 2
  for t in groups[0]:
    assert t.status is Status.TIMEOUT and t.reward == 0.0 and t.trainable
    assert t.metrics["ended_by"] == f"timeout/{why}"
    per_turn = len(engine.returned[0])
    turns = {"turns": 3, "tool_calls": 3, "tokens": -(-60 // per_turn)}[why]
    assert t.metrics["turns"] == turns
    assert t.num_sampled == (60 if why == "tokens" else turns * per_turn)
  dropped = run_episode("hermes", "hermes", always_call, budgets=Budgets(**budget),
                        timeouts="drop")
  assert dropped[3] == [[]] and dropped[2].counters["dropped_timeouts"] == 1


def test_wall_clock_budget_is_a_timeout():
  class Slow(et.CalcEnv):
    async def call_add(self, a, b):
      await asyncio.sleep(5)
      return str(a + b)
  from posttrain_jax.envs.env import register_env
  if "test_slow" not in __import__("posttrain_jax.envs.env", fromlist=["ENVS"]).ENVS.names():
    register_env("test_slow", et.CalcConfig)(Slow)
  _, _, _, groups = run_episode("hermes", "hermes", tool_then_answer("hermes"),
                                budgets=Budgets(max_seconds=0.5),
                                tasks=[et.calc_task(0, env="test_slow")])
  (t,) = groups[0]
  assert t.status is Status.TIMEOUT and t.metrics["ended_by"] == "timeout/seconds"


def _down_env() -> str:
  """Registers (once) "test_down": the calculator env whose tool backend is unreachable."""
  class Down(et.CalcEnv):
    async def call_add(self, a, b):
      raise EnvInfraError("tool_backend", "calculator service unreachable")
  from posttrain_jax.envs.env import ENVS, register_env
  if "test_down" not in ENVS.names():
    register_env("test_down", et.CalcConfig)(Down)
  return "test_down"


def test_an_infra_failure_is_excluded_not_scored():
  task = et.calc_task(0, env=_down_env())
  _, _, _, groups = run_episode("hermes", "hermes", tool_then_answer("hermes"), tasks=[task])
  (t,) = groups[0]
  assert t.status is Status.INFRA_ERROR and t.reward is None and not t.trainable
  assert t.metrics["infra/tool_backend"] == 1.0 and "unreachable" in t.metrics["error"]
  naive = run_episode("hermes", "hermes", tool_then_answer("hermes"), tasks=[task],
                      infra_scoring="zero")[3]
  assert naive[0][0].status is Status.OK and naive[0][0].reward == 0.0


def test_held_out_success_leaves_infra_failures_out_under_naive_scoring():
  """evaluate_episodes measures the policy: a task whose tool backend is down counts for
  nothing there, even when training scores it 0 (infra_scoring="zero")."""
  tasks = [et.calc_task(0, env=_down_env()), et.calc_task(1)]
  tok = et.tokenizer("hermes")
  stops = et.stop_ids(tok, "hermes")
  # every first turn calls the tool, every turn after its result answers
  script = lambda prompt, k: "The answer is 5." if "<tool_response>" in prompt else CALL["hermes"]  # noqa: E731
  engine = et.ScriptedEngine(tok, script, stops[0])
  for scoring in ("zero", "exclude"):
    ep = EnvEpisode(EnvEpisodeConfig(infra_scoring=scoring), engine, tok,
                    RolloutConfig(group_size=1), stops)
    trained = asyncio.run(ep.run([WorkItem(i, t) for i, t in enumerate(tasks)], seed=0))
    assert [t.reward for g in trained for t in g] == ([0.0, 1.0] if scoring == "zero"
                                                       else [None, 1.0])
    assert evaluate_episodes(ep, tasks, temperature=1.0, n=2, seed=0) == 1.0


class _BatchCostEngine(et.ScriptedEngine):
  """Costs 4 ms a row, like a batched engine on CPU: 0.5 s for a call of 128 rows."""

  def generate(self, prompts, sp, n=1, seed=None):
    time.sleep(0.004 * len(prompts))
    return super().generate(prompts, sp, n, seed)


def _two_tools_then_answer(prompt, k):
  return "The answer is 5." if prompt.count("<tool_response>") >= 2 else CALL["hermes"]


def test_an_episodes_seconds_do_not_depend_on_how_many_share_its_batch():
  """Issue 9: in lock-step turns every episode waited for the whole batch's generate, and that
  wait was charged to its wall-clock budget: the same policy succeeded on 2 episodes and timed
  out on 128 (a held-out eval is twice a training batch). Each episode now pays its own env
  steps and its share of each generate call."""
  tok = et.tokenizer("hermes")
  stops = et.stop_ids(tok, "hermes")
  engine = _BatchCostEngine(tok, _two_tools_then_answer, stops[0])
  ep = EnvEpisode(EnvEpisodeConfig(budgets=Budgets(max_seconds=0.6)), engine, tok,
                  RolloutConfig(group_size=1), stops)
  one = evaluate_episodes_detail(ep, [et.calc_task(0)], temperature=1.0, n=2, seed=0)
  many = evaluate_episodes_detail(ep, [et.calc_task(i) for i in range(64)], temperature=1.0,
                                  n=2, seed=0)
  assert one["accuracy"] == 1.0 and one["timeout_frac"] == 0.0
  assert many["accuracy"] == 1.0 and many["timeout_frac"] == 0.0 and many["episodes"] == 128
  # charged: ~3 turns x 4 ms (its share) + its tool steps, not the 3 x 0.26 s the batch took,
  # which is over the budget
  groups = asyncio.run(ep.run([WorkItem(i, et.calc_task(i)) for i in range(64)], seed=0))
  t = groups[0][0]
  assert t.status is Status.OK and t.metrics["episode_s"] > 0.6 > 0.3 > t.metrics["policy_s"]


def test_an_episodes_env_time_is_its_own_steps_not_the_turns_other_steps():
  """An env step with synchronous work (a sandbox spawn, a grader) runs on the event loop: the
  turn's 64 steps run one after another, and each is charged only its own ~5 ms."""
  class Busy(et.CalcEnv):
    async def call_add(self, a, b):
      time.sleep(0.005)
      return str(a + b)
  from posttrain_jax.envs.env import ENVS, register_env
  if "test_busy" not in ENVS.names():
    register_env("test_busy", et.CalcConfig)(Busy)
  _, _, _, groups = run_episode("hermes", "hermes", _two_tools_then_answer,
                                tasks=[et.calc_task(i, env="test_busy") for i in range(64)])
  env_s = [g[0].metrics["env_s"] for g in groups]
  assert all(g[0].status is Status.OK for g in groups)
  assert max(env_s) < 0.1 < 64 * 2 * 0.005   # own: 2 tool calls x 5 ms (+ slack)


def test_held_out_success_scores_timeouts_even_where_training_drops_them():
  """A naive `timeouts="drop"` run must not read its held-out success off the episodes that
  did not time out: eval scores a timeout as the failure it is, and says how many there were."""
  tok = et.tokenizer("hermes")
  stops = et.stop_ids(tok, "hermes")
  script = lambda prompt, k: CALL["hermes"]  # noqa: E731 -- calls the tool until a budget ends
  engine = et.ScriptedEngine(tok, script, stops[0])
  tasks = [et.calc_task(0), et.calc_task(1)]
  ep = EnvEpisode(EnvEpisodeConfig(budgets=Budgets(max_turns=2), timeouts="drop"), engine, tok,
                  RolloutConfig(group_size=1), stops)
  assert asyncio.run(ep.run([WorkItem(i, t) for i, t in enumerate(tasks)], seed=0)) == [[], []]
  d = evaluate_episodes_detail(ep, tasks, temperature=1.0, n=2, seed=0)
  assert d == {"accuracy": 0.0, "timeout_frac": 1.0, "infra_error_frac": 0.0, "episodes": 4.0}


def test_aborted_turn_is_infra_and_truncated_turn_follows_the_policy():
  _, _, _, groups = run_episode("hermes", "hermes", tool_then_answer("hermes"), finish="abort")
  assert groups[0][0].status is Status.INFRA_ERROR
  long = lambda p, k: "The answer is 5 " * 40  # noqa: E731 -- runs past turn_max_tokens
  _, _, _, groups = run_episode("hermes", "hermes", long, turn_max_tokens=16)
  (t,) = groups[0]
  assert t.status is Status.TRUNCATED and t.reward == 1.0 and t.num_sampled == 16


def test_groups_share_the_opening_and_envs_are_closed():
  closed = []

  class Tracked(et.CalcEnv):
    async def close(self):
      closed.append(self)
  from posttrain_jax.envs.env import ENVS, register_env
  if "test_tracked" not in ENVS.names():
    register_env("test_tracked", et.CalcConfig)(Tracked)
  tasks = [et.calc_task(i, env="test_tracked") for i in range(3)]
  _, engine, _, groups = run_episode("hermes", "hermes", tool_then_answer("hermes"),
                                     group_size=4, tasks=tasks)
  assert [len(g) for g in groups] == [4, 4, 4] and len(closed) == 12
  assert engine.calls == 2                     # one batched engine call per turn
  for g in groups:
    assert len({tuple(t.token_ids[:t.prompt_len]) for t in g}) == 1
    assert len({t.group_id for t in g}) == 1


def test_a_context_timeout_keeps_no_glue_past_the_last_turn():
  """The last tool result can push the stream past max_context_tokens (the next turn then never
  runs: timeout/context); the sample ends at the last sampled token, inside the context."""
  long_result = lambda p, k: CALL["hermes"]  # noqa: E731
  tok, engine, _, groups = run_episode("hermes", "hermes", long_result, turn_max_tokens=40,
                                       max_context_tokens=len(et.tokenizer("hermes")(
                                           "x")["input_ids"]) + 420,
                                       budgets=Budgets(max_turns=50, max_tool_calls=50))
  (t,) = groups[0]
  assert t.status is Status.TIMEOUT and t.metrics["ended_by"] == "timeout/context"
  assert t.loss_mask[-1] == 1 and len(t.token_ids) <= 421
  last = engine.prompts[-1] + engine.returned[-1]
  assert t.token_ids == last


def test_dropped_timeouts_are_a_visible_filter():
  """timeouts="drop" (the naive setting) removes episodes: the rollout source's per-step metrics
  say what fraction, so the audit's filter rule can see it."""
  from posttrain_jax.actors.rollout import SyncRollouts
  always_call = lambda p, k: CALL["hermes"]  # noqa: E731
  tok = et.tokenizer("hermes")
  stops = et.stop_ids(tok, "hermes")
  for mode, want in (("drop", 1.0), ("score", 0.0)):
    ep = EnvEpisode(EnvEpisodeConfig(budgets=Budgets(max_turns=2), timeouts=mode),
                    et.ScriptedEngine(tok, always_call, stops[0]), tok,
                    RolloutConfig(group_size=2), stops)
    source = SyncRollouts(ep, iter([et.calc_task(i) for i in range(4)]), group_size=2,
                          prompts_per_step=2)
    _, trajs = source.collect(0)
    assert len(trajs) == (0 if mode == "drop" else 4)
    assert source.metrics()["filter/dropped_timeout_frac"] == want
