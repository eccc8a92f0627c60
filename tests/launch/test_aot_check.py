"""Real configs (configs/qwen3.py, configs/llama3.py) and the AOT memory check
(posttrain_jax/aot.py, launch/aot_check.py): published architectures give the published
parameter counts; configs load for every size × slice and, without local paths, are refused
naming model.path / tasks.path; the check's parts are the bytes the shardings imply, it
allocates no weights, and a config that cannot fit is refused with the numbers."""
import dataclasses
import json
import os
import pathlib
import re
import resource
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from ml_collections.config_flags.config_flags import ConfigFileFlagParser

from posttrain_jax import aot
from posttrain_jax.config_io import ConfigTypeError
from posttrain_jax.configs._real import SLICES
from posttrain_jax.learner import Learner, LearnerConfig, abstract_train_state
from posttrain_jax.models import hf_io, published
from posttrain_jax.models.config import to_hf_dict
from posttrain_jax.run_config import RunConfig, run_config_from_dict
from posttrain_jax.sharding import MeshConfig, make_mesh

ROOT = pathlib.Path(__file__).resolve().parents[2]
REAL = [f"qwen3.py:{s},{sl}" for s in ("0.6b", "1.7b", "4b", "8b") for sl in SLICES] + [
    f"llama3.py:{s},{sl}" for s in ("1b", "3b") for sl in SLICES]


def raw_config(name: str) -> dict:
  return ConfigFileFlagParser(name="config").parse(str(ROOT / "configs" / name)).to_dict()


@pytest.mark.parametrize("name,count", [
    ("qwen3-0.6b", 596_049_920),    # the total quoted beside Qwen3-0.6B's config.json
    ("qwen3-1.7b", 1.72e9), ("qwen3-4b", 4.02e9), ("qwen3-8b", 8.19e9),  # model cards: 1.7B..8.2B
    ("llama3.2-1b", 1.24e9), ("llama3.2-3b", 3.21e9)])
def test_published_architectures_have_the_published_parameter_counts(name, count):
  n = published.model_config(name).num_params()
  assert n == count if isinstance(count, int) else abs(n - count) / count < 0.005
  hf = to_hf_dict(published.model_config(name))   # and round-trip as a config.json would
  assert all(hf[k] == v for k, v in published.hf_config(name).items()
             if k in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim",
                      "vocab_size", "tie_word_embeddings", "intermediate_size"))


def test_unknown_architecture_lists_the_known():
  with pytest.raises(ValueError, match="qwen3-8b"):
    published.model_config("qwen3-9b")


@pytest.mark.parametrize("name", REAL)
def test_real_configs_load_and_refuse_missing_paths(name):
  raw = raw_config(name)
  with pytest.raises(ConfigTypeError, match=r"config\.model: model\.path is required"):
    run_config_from_dict(raw)
  raw["model"]["path"] = "/models/x"
  with pytest.raises(ConfigTypeError, match=r"config\.tasks: TaskBankConfig\.path is required"):
    run_config_from_dict(raw)
  raw["tasks"]["path"] = "/data/gsm8k.jsonl"
  cfg = run_config_from_dict(raw)
  devices, _, mesh, engine, share = SLICES[name.split(",")[1]]
  assert isinstance(cfg, RunConfig) and cfg.rl.engine == engine
  assert cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor == devices
  micro_rows = cfg.rl.batch.rows // cfg.rl.learner.micro_batches
  assert micro_rows % (mesh["data"] * mesh["fsdp"]) == 0
  assert cfg.rl.prompts_per_step * cfg.rl.rollout.group_size == cfg.rl.batch.rows
  if engine == "vllm":
    e = cfg.engine_config()
    assert (e.dtype, e.max_model_len, e.gpu_memory_utilization) == ("bfloat16", 1024, share)
  assert aot.run_config_for_check(raw_config(name)).model.arch == cfg.model.arch


def test_real_config_paths_are_flags():
  """The paths are given as launch/train.py gives them (None-valued fields are flags too)."""
  from absl import flags
  from posttrain_jax.launch.cli import _parse_flags
  path = str(ROOT / "configs" / "qwen3.py")
  fv = flags.FlagValues()
  _parse_flags(["train", f"--config={path}:8b,h200x8", "--config.model.path=/m",
                "--config.tasks.path=/t.jsonl"], path, fv)
  cfg = run_config_from_dict(fv.config.to_dict())
  assert (cfg.model.path, cfg.tasks.path, cfg.model.arch) == ("/m", "/t.jsonl", "qwen3-8b")


@pytest.mark.devices(8)
def test_optimizer_state_is_sharded_like_the_params():
  """Adam's moments follow their parameter's sharding in the Learner and in the abstract
  state (the restore target / the AOT check): replicated, each device held all of them."""
  mesh = make_mesh(MeshConfig(fsdp=8))
  mc = published.model_config("qwen3-0.6b").replace(num_layers=1, vocab_size=512)
  learner = Learner(hf_io.init_model(mc, mesh=mesh), LearnerConfig(), mesh=mesh)
  abstract = abstract_train_state(hf_io.abstract_model(mc, mesh), LearnerConfig(), mesh)
  for real, want in zip(jax.tree.leaves(learner.state), jax.tree.leaves(abstract)):
    assert real.sharding == want.sharding
  mu = learner.state.opt_state[1][0].mu
  for m, p in zip(jax.tree.leaves(mu), jax.tree.leaves(learner.state.params)):
    assert m.sharding == p.sharding
  down = mu["layers"][0]["mlp"]["down_proj"]["kernel"]
  assert down.sharding.shard_shape(down.shape) == (3072, 1024 // 8)


# A small Qwen3 in a directory: model_config_of reads its config.json (no weights in it).
SMALL = dict(published.hf_config("qwen3-0.6b"), hidden_size=256, intermediate_size=512,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             vocab_size=4096)
SMALL_FLAGS = ["--config.rl.batch.rows=64", "--config.rl.batch.max_seqs=64",
               "--config.rl.batch.seq_len=128", "--config.rl.prompts_per_step=8",
               "--config.rl.learner.micro_batches=2"]


def small_dir(tmp_path) -> str:
  (tmp_path / "config.json").write_text(json.dumps(SMALL))
  return str(tmp_path)


def small_config(tmp_path) -> RunConfig:
  raw = raw_config("qwen3.py:0.6b,h200x8")
  raw["model"]["path"] = small_dir(tmp_path)
  raw["rl"]["batch"].update(rows=64, max_seqs=64, seq_len=128)
  raw["rl"]["prompts_per_step"] = 8
  raw["rl"]["learner"]["micro_batches"] = 2
  return aot.run_config_for_check(raw)


@pytest.mark.devices(8)
def test_report_parts_are_the_bytes_the_shardings_imply(tmp_path):
  cfg = small_config(tmp_path)
  mesh = make_mesh(cfg.mesh)
  before = {id(a) for a in jax.live_arrays()}
  report, compiled = aot.check(cfg, mesh, int(141 * aot.GIB))
  new = [a for a in jax.live_arrays() if id(a) not in before]
  assert not [a for a in new if a.size > 4096], "the check allocated arrays"
  mc = aot.model_config_of(cfg)
  n = mc.num_params()
  parts = {name: b for name, b, _ in report.parts}
  # every matrix is split 8 ways along its embed axis; only the 2-layer norms (256 and 64
  # wide, replicated) are whole on each device
  norms = 2 * (2 * 256 + 2 * 64) + 256
  assert parts["params"] == ((n - norms) // 8 + norms) * 4
  assert parts["optimizer state"] == 2 * parts["params"] + 2 * 4   # mu, nu; two counts
  assert parts["reference params (rl.reference_kl)"] == parts["params"]
  rows_per_device, fields = 64 // 8, 4 + 4 + 1  # int ids x4, masks/adv/behaviour/ref x5
  assert parts["batch"] == rows_per_device * 128 * 4 * fields + 64 * 4
  assert report.compiler["argument_size_in_bytes"] >= parts["params"] + parts["optimizer state"]
  assert report.compiler["alias_size_in_bytes"] >= parts["params"] + parts["optimizer state"]
  assert report.total_bytes == sum(parts.values())
  assert report.capacity_bytes == int(141 * aot.GIB * 0.7)   # vLLM's 30 % of GPU 0
  assert report.fits and report.result_line().endswith("fits=1")
  assert parts["activations, gathered weights (in temps)"] > 0 and parts["gradients (in temporaries)"] > 0


def _cli(*args, timeout=900):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run([sys.executable, str(ROOT / "launch" / "aot_check.py"), *args],
                        capture_output=True, text=True, env=env, timeout=timeout)


def test_cli_refuses_a_config_that_cannot_fit_with_the_numbers(tmp_path):
  out = _cli("--config=" + str(ROOT / "configs" / "qwen3.py") + ":0.6b,v5e8",
             f"--config.model.path={small_dir(tmp_path)}", *SMALL_FLAGS,
             "--device_memory_gb=0.01")
  assert out.returncode == 1, out.stderr
  assert out.stdout.strip().splitlines()[-1].startswith("RESULT per_device_gb=")
  assert out.stdout.strip().endswith("capacity_gb=0.01 fits=0")
  err = out.stderr.strip().splitlines()[-1]
  assert err.startswith("error: does not fit: ") and "capacity 0.01 GiB" in err
  for part in ("params", "optimizer state", "activations, gathered weights", "reference params"):
    assert part in err
  fits = _cli("--config=" + str(ROOT / "configs" / "qwen3.py") + ":0.6b,v5e8",
              f"--config.model.path={small_dir(tmp_path)}", *SMALL_FLAGS)
  assert fits.returncode == 0, fits.stderr
  assert "target v5e 16 GiB/device" in fits.stdout and fits.stdout.strip().endswith("fits=1")


def _result(stdout: str) -> dict:
  m = re.search(r"RESULT per_device_gb=([\d.]+) capacity_gb=([\d.]+) fits=(\d)", stdout)
  return dict(gb=float(m[1]), capacity=float(m[2]), fits=int(m[3]))


def _part(stdout: str, name: str) -> float:
  return float(re.search(rf"^{re.escape(name)}\s+([\d.]+)", stdout, re.M)[1])


@pytest.mark.slow
def test_qwen3_8b_on_8_fake_devices_without_weights():
  """The Qwen3-8B config on an 8-device fake mesh: reported, fits an H200 beside vLLM, and the
  process never holds the weights (peak RSS far below their 32.8 GB in float32). ~2 min."""
  out = _cli("--config=" + str(ROOT / "configs" / "qwen3.py") + ":8b,h200x8")
  assert out.returncode == 0, out.stderr
  n = published.model_config("qwen3-8b").num_params()
  assert abs(_part(out.stdout, "params") - n * 4 / 8 / aot.GIB) < 0.01
  assert abs(_part(out.stdout, "optimizer state") - 2 * n * 4 / 8 / aot.GIB) < 0.01
  r = _result(out.stdout)
  assert r["fits"] == 1 and r["capacity"] == pytest.approx(141 * 0.7, abs=0.01)
  peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
  assert peak < n * 4 / 8, f"peak RSS {peak / 1e9:.1f} GB"


@pytest.mark.slow
def test_qwen3_8b_on_v5e8_is_refused():
  out = _cli("--config=" + str(ROOT / "configs" / "qwen3.py") + ":8b,v5e8")
  assert out.returncode == 1 and "does not fit" in out.stderr
  assert _result(out.stdout)["fits"] == 0 and _result(out.stdout)["capacity"] == 16.0



@pytest.mark.devices(8)
def test_lora_report_counts_the_frozen_base_once_and_the_adapters_as_params(tmp_path):
  """LoRA (bf16 base): params and optimizer state are the adapters'; the base is its own exact
  row at 2 bytes a parameter; the reference (adapters at zero) costs the adapters again."""
  cfg = small_config(tmp_path)
  lora_cfg = dataclasses.replace(cfg.rl.learner.lora, rank=8, base_dtype="bfloat16")
  cfg = dataclasses.replace(cfg, rl=dataclasses.replace(
      cfg.rl, learner=dataclasses.replace(cfg.rl.learner, lora=lora_cfg)))
  mesh = make_mesh(cfg.mesh)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1}
  report, compiled = aot.check(cfg, mesh, int(141 * aot.GIB))
  parts = {name: b for name, b, _ in report.parts}
  n = aot.model_config_of(cfg).num_params()
  norms = 2 * (2 * 256 + 2 * 64) + 256
  assert parts["frozen base (LoRA; params are the adapters)"] == ((n - norms) // 8 + norms) * 2
  # float32 adapters, r = 8, per device: an "embed" dimension is split 8 ways (fsdp), the rest
  # whole. A [in, 8]: q k v gate up 256/8 rows, o 256 rows, down 512 rows; B [8, out]: q 256,
  # k v 128, o 256/8, gate up 512, down 256/8 columns.
  a = 8 * (5 * 32 + 256 + 512)
  b = 8 * (256 + 2 * 128 + 32 + 2 * 512 + 32)
  assert parts["params"] == 2 * (a + b) * 4
  assert parts["optimizer state"] == 2 * parts["params"] + 2 * 4
  assert parts["reference params (rl.reference_kl)"] == parts["params"]
  assert report.total_bytes == sum(parts.values())
