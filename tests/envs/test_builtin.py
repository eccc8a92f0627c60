"""The built-in environments (tool_math, file_task) through the multi-turn episode, with the real
bubblewrap sandbox; the policy is scripted (what a model would write)."""
import asyncio
import re
import shutil

import pytest

from posttrain_jax.actors.episode import WorkItem
from posttrain_jax.actors.multiturn import EnvEpisode, EnvEpisodeConfig, demonstration_trajectory
from posttrain_jax.actors.rollout import RolloutConfig
from posttrain_jax.envs.env import Budgets
from posttrain_jax.envs.file_task import FileTaskTasks
from posttrain_jax.tasks.synthetic import distinct_tasks
from posttrain_jax.envs.tool_math import ToolMathTasks
from posttrain_jax.types import Status
from tests.support import envs as et

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="needs bubblewrap: apt-get install bubblewrap")


def episode(script, tasks, chat_format="hermes", tool_format="hermes", env_config=None, G=1,
            **cfg):
  tok = et.tokenizer(chat_format)
  stops = et.stop_ids(tok, chat_format)
  engine = et.ScriptedEngine(tok, script, stops[0])
  ep = EnvEpisode(EnvEpisodeConfig(tool_format=tool_format, env_config=env_config,
                                   max_context_tokens=2048, **cfg),
                  engine, tok, RolloutConfig(group_size=G), stops)
  return asyncio.run(ep.run([WorkItem(i, t) for i, t in enumerate(tasks)], seed=0)), engine


def math_tasks(n=3, **kw):
  return distinct_tasks("tool_math", ToolMathTasks(**kw), n, seed=0, partition="train")


def call(code):
  return '<tool_call>\n{"name": "python", "arguments": {"code": "%s"}}\n</tool_call>' % code


def test_tool_math_tasks_replay_from_the_seed():
  a, b = math_tasks(5), math_tasks(5)
  assert [t.to_dict() for t in a] == [t.to_dict() for t in b]
  for t in a:
    x, op, y = re.fullmatch(r"(\d+)([*+-])(\d+)", t.metadata["expression"]).groups()
    assert int(t.answer) == {"*": int(x) * int(y), "+": int(x) + int(y),
                             "-": int(x) - int(y)}[op]
  hard = distinct_tasks("tool_math", ToolMathTasks(hard_fraction=1.0, hard_digits=9), 3, seed=0,
                        partition="train")
  assert {t.metadata["difficulty"] for t in hard} == {"hard"}
  assert all(len(str(t.metadata["expression"]).split("*")[0]) == 9 for t in hard
             if "*" in t.metadata["expression"])
  mixed = distinct_tasks("tool_math", ToolMathTasks(min_digits=2, max_digits=2, ops="+",
                                                   hard_fraction=0.5, hard_digits=2, hard_ops="*"),
                         40, seed=0, partition="train")
  ops = {(t.metadata["difficulty"], "*" if "*" in t.metadata["expression"] else "+") for t in mixed}
  assert ops == {("easy", "+"), ("hard", "*")}


def test_tool_math_solved_with_the_sandboxed_tool():
  def script(prompt, k):
    if k == 0:
      return call("print(%s)" % re.findall(r"Compute (\S+)\.", prompt)[-1])
    return "The answer is %s." % re.findall(r"<tool_response>\n(-?\d+)\n", prompt)[-1]
  tasks = math_tasks(3)
  groups, engine = episode(script, tasks, G=2)
  for g, task in zip(groups, tasks):
    assert [t.reward for t in g] == [1.0, 1.0] and {t.status for t in g} == {Status.OK}
    assert g[0].metrics["tool_calls"] == 1.0 and g[0].metrics["turns"] == 2.0
    tool_msg = [m for m in g[0].messages if m["role"] == "tool"][0]
    assert tool_msg["content"] == task.answer     # the sandbox's python computed it


def test_tool_math_wrong_answer_and_policy_tool_errors():
  def script(prompt, k):
    return [call("raise ValueError(7)"), call("while True: pass"), "The answer is 12."][k]
  groups, _ = episode(script, math_tasks(1), budgets=Budgets(max_seconds=60.0))
  (t,) = groups[0]
  assert t.status is Status.OK and t.reward == 0.0
  assert t.metrics["tool_errors/tool_failed"] == 1.0 and t.metrics["tool_errors/tool_timeout"] == 1.0
  msgs = [m["content"] for m in t.messages if m["role"] == "tool"]
  assert "exit code 1" in msgs[0] and "ValueError: 7" in msgs[0]
  assert "killed:" in msgs[1]


def test_injected_tool_backend_faults_are_infra_errors():
  def script(prompt, k):
    return call("print(1)") if k == 0 else "1"
  groups, _ = episode(script, math_tasks(1), env_config=dict(infra_fault_rate=0.999), G=3)
  assert {t.status for t in groups[0]} == {Status.INFRA_ERROR}
  assert all(t.metrics["infra/tool_backend"] == 1.0 and t.reward is None for t in groups[0])


@pytest.mark.parametrize("chat_format,tool_format", [("hermes", "hermes"),
                                                     ("llama3", "llama3_json")])
def test_demonstrations_stitch_and_match_the_real_tool(chat_format, tool_format):
  """The SFT chat of each env is one token-exact sample, and what it shows as the tool's output
  is what the real tool returns: replaying the demonstration as the policy earns reward 1."""
  tok = et.tokenizer(chat_format)
  stops = et.stop_ids(tok, chat_format)
  cfg = EnvEpisodeConfig(tool_format=tool_format, max_context_tokens=2048)
  from posttrain_jax.envs.env import env_spec
  files = distinct_tasks("file_task", FileTaskTasks(), 2, seed=0, partition="train")
  for task in [*math_tasks(2), *files]:
    demo = env_spec(task.metadata["env"]).demonstration(task, tool_format)
    t = demonstration_trajectory(tok, task, cfg, stops, "sft")
    said = [m["content"] for m in demo if m["role"] == "assistant"]
    assert tok.decode([i for i, m in zip(t.token_ids, t.loss_mask) if m],
                      skip_special_tokens=False) == "".join(
                          s + tok.convert_ids_to_tokens(stops[0]) for s in said)
    groups, _ = episode(lambda p, k: said[k], [task], chat_format, tool_format,
                        turn_max_tokens=400)
    (run,) = groups[0]
    assert run.reward == 1.0, (task.id, run.messages)
    got = [m["content"] for m in run.messages if m["role"] == "tool"]
    assert got == [m["content"] for m in demo if m["role"] == "tool"]


def test_file_task_goals_are_checked_in_the_work_dir():
  tasks = distinct_tasks("file_task", FileTaskTasks(kinds="sum"), 2, seed=1, partition="train")
  nums = [int(x) for x in tasks[0].metadata["files"]["numbers.txt"].split()]

  def wrong(prompt, k):
    return ['<tool_call>{"name": "write_file", "arguments": {"path": "answer.txt", '
            f'"content": "{sum(nums) + 1}"}}}}</tool_call>', "Done."][k]
  groups, _ = episode(wrong, tasks[:1])
  assert groups[0][0].reward == 0.0

  def shell(prompt, k):
    return ['<tool_call>{"name": "shell", "arguments": {"command": '
            '"paste -sd+ numbers.txt | bc > answer.txt || python3 -c \\"print(sum(int(x) for x in '
            'open(\'numbers.txt\')))\\" > answer.txt"}}</tool_call>', "Done."][k]
  groups, _ = episode(shell, tasks[:1])
  assert groups[0][0].reward == 1.0, groups[0][0].messages

  def escape(prompt, k):
    return ['<tool_call>{"name": "read_file", "arguments": {"path": "../../etc/passwd"}}</tool_call>',
            '<tool_call>{"name": "write_file", "arguments": {"path": "/tmp/x", "content": "1"}}'
            '</tool_call>', "Done."][k]
  groups, _ = episode(escape, tasks[:1])
  t = groups[0][0]
  assert t.metrics["tool_errors/tool_failed"] == 2.0 and t.reward == 0.0
  assert all("error:" in m["content"] for m in t.messages if m["role"] == "tool")


def test_file_tasks_replay_and_replace_goal():
  a = distinct_tasks("file_task", FileTaskTasks(kinds="replace"), 3, seed=2, partition="train")
  assert [t.to_dict() for t in a] == [t.to_dict() for t in
                                      distinct_tasks("file_task", FileTaskTasks(kinds="replace"),
                                                     3, seed=2, partition="train")]
  for t in a:
    text = t.metadata["files"]["notes.txt"]
    w, v = re.findall(r"'(\w+)'", t.prompt)
    assert w in text and t.metadata["goal"]["content"] == text.replace(w, v).strip()
