"""Shared pieces for the multi-turn tests: tiny tokenizers per chat format, a scripted policy,
and a small calculator environment.

`ScriptedEngine` stands in for the *policy* (what a model would write), not for an engine under
test: it answers each prompt with the next text of a script, as token ids the test chooses
(canonical tokenisation, or byte by byte to imitate a model that samples non-canonical
splits), with distinct made-up log-probs, and records every prompt it was sent.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

from posttrain_jax.engines.base import Completion
from posttrain_jax.envs.env import ToolEnv, ToolEnvConfig, ToolSpec, register_env
from posttrain_jax.tasks.task import Task
from posttrain_jax.models import hf_io
from posttrain_jax.models.chat_templates import CHAT_FORMATS
from posttrain_jax.models.tiny import TinyModelConfig, build_tiny_model

SMALL = dict(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
             head_dim=16)


@functools.lru_cache(maxsize=None)
def tiny_dir(chat_format: str, **kw):
  return build_tiny_model(TinyModelConfig(chat_format=chat_format, **{**SMALL, **kw}))


@functools.lru_cache(maxsize=None)
def tokenizer(chat_format: str):
  return hf_io.load_tokenizer(tiny_dir(chat_format))


def stop_ids(tok, chat_format: str) -> tuple[int, ...]:
  return tuple(tok.convert_tokens_to_ids(e) for e in CHAT_FORMATS.get(chat_format).eos)


class ScriptedEngine:
  """Answers prompt i of call k with `script(prompt_text, k)`; `split="bytes"` samples each
  character as its own token where the vocabulary has it (a non-canonical tokenisation)."""

  def __init__(self, tok, script: Callable[[str, int], str], stop: int, split: str = "bpe",
               finish: str = "stop"):
    self.tok, self.script, self.stop, self.split, self.finish = tok, script, stop, split, finish
    self.version = 0
    self.prompts: list[list[int]] = []
    self.returned: list[list[int]] = []
    self.texts: list[str] = []
    self.calls = 0

  def _ids(self, text: str) -> list[int]:
    if self.split == "bytes":
      out = []
      for ch in text:
        out += self.tok(ch, add_special_tokens=False)["input_ids"]
      return out
    return list(self.tok(text, add_special_tokens=False)["input_ids"])

  def generate(self, prompts: Sequence[Sequence[int]], sp, n: int = 1, seed=None):
    out = []
    for p in prompts:
      self.prompts.append(list(p))
      text = self.script(self.tok.decode(list(p), skip_special_tokens=False), self.calls)
      self.texts.append(text)
      ids = self._ids(text)[:sp.max_tokens]
      finish = self.finish
      if len(ids) < sp.max_tokens and finish == "stop":
        ids.append(self.stop)
      else:
        finish = "length" if finish == "stop" else finish
      self.returned.append(ids)
      lps = [-0.01 * (len(self.returned) + i) for i in range(len(ids))]
      out.append([Completion(token_ids=ids, logprobs=lps, finish_reason=finish,
                             version=self.version)])
    self.calls += 1
    return out

  def update_weights(self, params, version: int) -> None:
    self.version = version


@dataclasses.dataclass(frozen=True)
class CalcConfig:
  """The test calculator: add two numbers with a tool, then answer."""
  a: int = 2                      # first operand
  b: int = 3                      # second operand
  follow_up: bool = False         # after the first answer, a user turn asks to double-check
  tool: ToolEnvConfig = ToolEnvConfig()


class CalcEnv(ToolEnv):
  tools = (ToolSpec("add", "Adds two integers.",
                    {"type": "object", "properties": {"a": {"type": "integer"},
                                                      "b": {"type": "integer"}},
                     "required": ["a", "b"]}),)

  def __init__(self, cfg: CalcConfig):
    super().__init__(cfg.tool)
    self.cfg = cfg
    self.asked_again = False
    self.closed = False

  async def opening(self, task: Task, seed: int):
    return [{"role": "system", "content": "Use the tools."},
            {"role": "user", "content": f"What is {self.cfg.a} + {self.cfg.b}?"}]

  async def call_add(self, a: int, b: int) -> str:
    return str(a + b)

  async def step(self, turn):
    if not turn.tool_calls and not turn.malformed and self.cfg.follow_up and not self.asked_again:
      self.asked_again = True
      from posttrain_jax.envs.env import EnvStep
      return EnvStep([{"role": "user", "content": "Are you sure?"}])
    return await super().step(turn)

  async def grade(self, turn) -> float:
    return 1.0 if str(self.cfg.a + self.cfg.b) in turn.content else 0.0

  async def close(self):
    self.closed = True


register_env("test_calc", CalcConfig)(CalcEnv)


def calc_task(i: int = 0, **meta) -> Task:
  return Task(id=f"calc:{i}", prompt="(environment)", answer="", metadata={"env": "test_calc",
                                                                           "seed": i, **meta})


import asyncio
from posttrain_jax.actors.episode import WorkItem
from posttrain_jax.actors.multiturn import (EnvEpisode, EnvEpisodeConfig)
from posttrain_jax.actors.rollout import RolloutConfig
from posttrain_jax.envs.env import ToolEnvConfig
from tests.support import envs as et


CALL = {"hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        "llama3_json": '{"name": "add", "parameters": {"a": 2, "b": 3}}'}


def run_episode(chat_format, tool_format, script, group_size=1, split="bpe", finish="stop",
                tasks=None, **cfg):
  tok = et.tokenizer(chat_format)
  stops = et.stop_ids(tok, chat_format)
  engine = et.ScriptedEngine(tok, script, stops[0], split=split, finish=finish)
  env_cfg = cfg.pop("env_config", None)
  ep = EnvEpisode(EnvEpisodeConfig(tool_format=tool_format, env_config=env_cfg, **cfg), engine,
                  tok, RolloutConfig(group_size=group_size), stops)
  items = [WorkItem(i, t) for i, t in enumerate(tasks or [et.calc_task()])]
  groups = asyncio.run(ep.run(items, seed=0))
  return tok, engine, ep, groups


def tool_then_answer(fmt):
  def script(prompt, k):
    return CALL[fmt] if k == 0 else "The answer is 5."
  return script

