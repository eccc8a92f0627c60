"""Extension by registration, shown by doing it: a toy loss, engine, model family, environment,
grader, task source and rollout source are each written as ONE new file into the folder its
registry discovers, and a fresh process then trains with all of them (and steps the toy
environment) without any other file of the project changed. Each toy's own behaviour is checked
from what the run wrote, so a toy the registry silently ignored fails the test."""
import hashlib
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "posttrain_jax"

TOYS = {
    # a loss: REINFORCE on the batch's advantages, with a metric of its own
    PKG / "losses" / "toy_ext_loss.py": '''
        """toy_ext: -mean_t A_t log pi(y_t) (plain REINFORCE), for tests/run/test_extension.py."""
        import dataclasses
        import jax.numpy as jnp
        from posttrain_jax.losses.base import register_loss, weighted

        @dataclasses.dataclass(frozen=True)
        class ToyLossConfig:
          scale: float = 1.0

        @register_loss("toy_ext", ToyLossConfig, inputs=())
        def toy_loss(logp_bt, batch, cfg):
          m = batch.loss_mask
          n = jnp.maximum(m.sum(), 1.0)
          loss = -cfg.scale * jnp.sum(m * batch.advantages * logp_bt) / n
          return loss, {"loss": weighted(loss * n, n), "toy_ext_loss": weighted(n, n)}
    ''',
    # an engine: the embedded sampler, counting its calls
    PKG / "engines" / "toy_ext_engine.py": '''
        """toy_ext: the embedded sampler, counting generate calls (tests/run/test_extension.py)."""
        from posttrain_jax.engines import jax_sampler
        from posttrain_jax.engines.registry import register_engine

        class Counting:
          def __init__(self, inner):
            self.inner, self.calls = inner, 0
          def generate(self, *args, **kwargs):
            self.calls += 1
            return self.inner.generate(*args, **kwargs)
          def metrics(self):
            return {"toy_ext_engine/calls": float(self.calls)}
          def __getattr__(self, name):
            return getattr(self.inner, name)

        @register_engine("toy_ext", jax_sampler.JaxSamplerConfig, shareable=False,
                         processes="lockstep")
        def build(cfg, ctx):
          return Counting(jax_sampler._build(cfg, ctx))
    ''',
    # a model family: Qwen3's switches under a name and an architecture of its own
    PKG / "models" / "families" / "toy_ext_family.py": '''
        """toy_ext: Qwen3's decoder under its own name (tests/run/test_extension.py)."""
        from posttrain_jax.models.families import ModelFamily, register_family

        register_family(ModelFamily(
            name="toy_ext", architectures=("ToyExtForCausalLM",),
            from_hf=lambda hf: dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True),
            to_hf=lambda cfg: {"toy_ext": True}))
    ''',
    # a grader whose rewards no 0/1 grader gives: 0.31 or 0.32 by the completion's length
    PKG / "graders" / "toy_ext_grader.py": '''
        """toy_ext: 0.31 or 0.32 by the parity of the completion's length (test_extension.py)."""
        import dataclasses
        from posttrain_jax.graders.base import GradeResult, register_grader

        @dataclasses.dataclass(frozen=True)
        class ToyGraderConfig:
          pass

        @register_grader("toy_ext", ToyGraderConfig)
        def toy_grader(completion, task, cfg):
          return GradeResult(0.31 if len(completion) % 2 else 0.32, {"parse_ok": True})
    ''',
    # a task source that reads no file: "k+0=", blocks of 7 k's alternating train / held out
    PKG / "tasks" / "toy_ext_tasks.py": '''
        """toy_ext: a task source without a file (tests/run/test_extension.py)."""
        import sys
        from posttrain_jax.tasks.bank import register_task_source
        from posttrain_jax.tasks.task import Task

        class Stream:
          def __init__(self, held_out):
            self.held_out = held_out
          def __len__(self):
            return sys.maxsize
          def __getitem__(self, i):
            k = 2 * 7 * (i // 7) + i % 7 + (7 if self.held_out else 0)
            return Task(id=f"toy{k}", prompt=f"{k}+0=", answer=str(k))

        def eval_tasks(cfg, n):
          s = Stream(True)
          return [s[i] for i in range(n)]

        @register_task_source("toy_ext", reads_path=False, eval_tasks=eval_tasks)
        def open_toy(cfg, path, eval_fraction):
          return Stream(False)
    ''',
    # a rollout source: sync, counting its collects in the step metrics
    PKG / "run" / "sources" / "toy_ext_source.py": '''
        """toy_ext: the sync source, counting its collects (tests/run/test_extension.py)."""
        from posttrain_jax.run.sources import register_source
        from posttrain_jax.run.sources.sync import build_sync, draws_per_step

        class Counting:
          def __init__(self, inner):
            self.inner, self.collects = inner, 0
          def collect(self, step):
            self.collects += 1
            return self.inner.collect(step)
          def metrics(self):
            return {**self.inner.metrics(), "toy_ext_source/collects": float(self.collects)}
          def __getattr__(self, name):
            return getattr(self.inner, name)

        @register_source("toy_ext", oversamples=True, draws_per_step=draws_per_step)
        def build(ctx):
          return Counting(build_sync(ctx))
    ''',
    # an environment: one tool that echoes, graded on the final answer
    PKG / "envs" / "toy_ext_env.py": '''
        """toy_ext: a tool environment with an echo tool (tests/run/test_extension.py)."""
        import dataclasses
        from posttrain_jax.envs.env import ToolEnv, ToolEnvConfig, ToolSpec, register_env

        @dataclasses.dataclass(frozen=True)
        class ToyEnvConfig(ToolEnvConfig):
          pass

        class ToyEnv(ToolEnv):
          tools = (ToolSpec("echo", "Repeats its text.",
                            {"type": "object", "properties": {"text": {"type": "string"}},
                             "required": ["text"]}),)
          async def opening(self, task, seed):
            self.answer = task.answer
            return [{"role": "user", "content": task.prompt}]
          async def call_echo(self, text):
            return text
          async def grade(self, turn):
            return float(turn.content.strip() == self.answer)

        register_env("toy_ext", ToyEnvConfig)(ToyEnv)
    ''',
}

RUN = '''
import asyncio, json, sys
from posttrain_jax.envs import env_spec
from posttrain_jax.envs.tool_calls import ParsedTurn, ToolCall
from posttrain_jax.metrics import read_metrics
from posttrain_jax.run import Trainer
from posttrain_jax.run_config import run_config_from_dict
from posttrain_jax.tasks import Task

workdir = sys.argv[1]
cfg = run_config_from_dict({
    "workdir": workdir, "seed": 0, "grader": "toy_ext",
    "model": {"tiny": {"family": "toy_ext", "vocab_size": 320, "hidden_size": 32,
                       "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
                       "num_kv_heads": 2, "head_dim": 8, "corpus_lines": 500}},
    "tasks": {"source": "toy_ext", "eval_size": 4},
    "sft": {"steps": 0},
    "rl": {"mode": "toy_ext", "engine": "toy_ext", "steps": 2, "prompts_per_step": 2,
           "rollout": {"group_size": 4, "max_tokens": 4},
           "learner": {"loss": "toy_ext", "optimizer": {"learning_rate": 1e-3}},
           "batch": {"rows": 8, "seq_len": 32, "max_seqs": 8, "pack": False}},
    "eval": {"every_steps": 0, "samples_per_prompt": 1, "max_tokens": 4, "greedy": False},
    "checkpoint": {"every_steps": 0}})
assert Trainer(cfg, log=lambda *_: None).run() is not None
rows = [r for r in read_metrics(f"{workdir}/metrics.jsonl") if "reward/mean" in r]
spec = env_spec("toy_ext")
env = spec.build(spec.config_cls())
task = Task(id="t", prompt="say 3", answer="3")
async def episode():
  await env.reset(task, 0)
  tool = await env.step(ParsedTurn("", (ToolCall("echo", {"text": "hi"}, "c1"),)))
  final = await env.step(ParsedTurn("3"))
  return tool.messages[0]["content"], final.reward
echoed, reward = asyncio.run(episode())
print(json.dumps({"rows": rows, "echoed": echoed, "reward": reward,
                  "config": json.load(open(f"{workdir}/final_model/config.json"))}))
'''


def _digest() -> dict[str, str]:
  return {str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest()
          for d in ("posttrain_jax", "kernels", "launch", "configs") for p in (ROOT / d).rglob("*")
          if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture
def toys():
  for path in TOYS:
    assert not path.exists(), f"{path} exists already"
  before = _digest()
  for path, text in TOYS.items():
    path.write_text(textwrap.dedent(text).lstrip())
  try:
    yield before
  finally:
    for path in TOYS:
      path.unlink(missing_ok=True)
      for cached in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        cached.unlink()


@pytest.mark.slow  # a real (tiny) training run in a fresh process: ~40 s
def test_one_new_file_each_for_a_loss_engine_family_env_grader_task_source_rollout_source(
    toys, tmp_path):
  proc = subprocess.run([sys.executable, "-c", RUN, str(tmp_path / "run")], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  after = _digest()
  added = sorted(set(after) - set(toys))
  changed = sorted(k for k in toys if after.get(k) != toys[k])
  assert added == sorted(str(p.relative_to(ROOT)) for p in TOYS) and not changed, (added, changed)
  rows = out["rows"]
  assert len(rows) == 2
  assert [r["toy_ext_source/collects"] for r in rows] == [1.0, 2.0]    # the rollout source
  assert rows[-1]["toy_ext_engine/calls"] >= 2.0                        # the engine sampled
  assert all("toy_ext_loss" in r for r in rows)                        # the loss trained
  assert all(0.31 <= r["reward/mean"] <= 0.32 for r in rows)           # the grader graded
  cfg = out["config"]
  assert cfg["architectures"] == ["ToyExtForCausalLM"] and cfg["toy_ext"] is True  # the family
  assert out["echoed"] == "hi" and out["reward"] == 1.0                 # the environment
