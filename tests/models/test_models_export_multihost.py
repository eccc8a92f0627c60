"""save_hf_model in a 2-process job (4 CPU devices each), parameters sharded over fsdp across
both processes: every process gathers, only process 0 writes, every process returns after
the files exist, and a failed write raises on every process and leaves nothing behind."""
import json

import numpy as np
import pytest

from posttrain_jax import sharding as shd
from posttrain_jax.models import hf_io
from tests.support.distributed import run_processes
from tests.support.learner import CFG

MODEL = CFG.replace(tie_word_embeddings=False)  # hidden 32: fsdp=8 divides "embed"

WORKER = r"""
import json, pathlib, sys
import jax
from posttrain_jax import sharding
sharding.initialize_distributed()
from flax import nnx
from posttrain_jax.models import hf_io
from tests.support.learner import CFG

out = pathlib.Path(sys.argv[1])
mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=-1, tensor=1))
model = hf_io.init_model(CFG.replace(tie_word_embeddings=False), 0, mesh)
arrays = [v[...] for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
report = {"proc": jax.process_index(), "devices": jax.device_count(),
          "fsdp_sharded": sum("fsdp" in str(a.sharding.spec) and not a.is_fully_addressable
                              for a in arrays), "params": len(arrays)}

real_write = hf_io.write_safetensors
writes = []
def counting(path, tensors, *args, **kwargs):
  writes.append(path.name)
  return real_write(path, tensors, *args, **kwargs)
def failing(path, tensors, *args, **kwargs):
  if writes:  # process 0's second file: after one file is already on disk
    raise OSError("disk full (injected)")
  return counting(path, tensors, *args, **kwargs)

hf_io.write_safetensors = failing
try:
  hf_io.save_hf_model(model, out / "broken", max_shard_bytes=20_000)
  report["failed_with"] = None
except Exception as e:
  report["failed_with"] = f"{type(e).__name__}: {e}"
report["left_behind"] = sorted(p.name for p in out.iterdir() if "broken" in p.name)

hf_io.write_safetensors = counting
writes.clear()
hf_io.save_hf_model(model, out / "model", max_shard_bytes=20_000)
report["exists_on_return"] = sorted(p.name for p in (out / "model").iterdir())
report["writes"] = writes
print(json.dumps(report))
"""


@pytest.mark.devices(8)
def test_two_process_export_gathers_everywhere_writes_once(tmp_path):
  out = tmp_path / "export"
  out.mkdir()
  reports = [json.loads(o.strip().splitlines()[-1])
             for o in run_processes(WORKER, tmp_path, processes=2, devices=4, args=[str(out)],
                                    timeout=240)]
  p0, p1 = reports
  assert (p0["proc"], p1["proc"], p0["devices"]) == (0, 1, 8)
  assert p0["fsdp_sharded"] >= 8, p0  # the matrices really are split across the processes

  # A failed write: both processes raise (none hangs); neither sees anything of it on disk.
  assert p0["failed_with"] == "OSError: disk full (injected)"
  assert p1["failed_with"].startswith("ExportError: process 0 failed to write"), p1
  assert p0["left_behind"] == p1["left_behind"] == []

  # The export: only process 0 wrote, and both returned after the whole directory existed.
  files = sorted(f for f in (out / "model").iterdir())
  shards = [f.name for f in files if f.suffix == ".safetensors"]
  assert len(shards) > 1 and sorted(p0["writes"]) == shards
  assert p1["writes"] == []
  assert p0["exists_on_return"] == p1["exists_on_return"] == [f.name for f in files]

  # The files load back and equal the same parameters gathered in one process (8 devices).
  want = hf_io.hf_tensors(hf_io.init_model(MODEL, 0, shd.make_mesh(shd.MeshConfig(fsdp=-1))))
  got = dict(hf_io.hf_tensors(hf_io.load_hf_model(out / "model")))
  names = []
  for name, arr in want:
    names.append(name)
    np.testing.assert_array_equal(got[name], arr, err_msg=name)
  assert sorted(names) == sorted(got)


TINY_WORKER = r"""
import pathlib, sys, time
import jax
from posttrain_jax import sharding
sharding.initialize_distributed()
from posttrain_jax.models.tiny import TinyModelConfig, build_tiny_model
if jax.process_index() == 1:
  time.sleep(float(sys.argv[2]))   # process 0 is done with its own work long before
d = build_tiny_model(TinyModelConfig(vocab_size=320, hidden_size=32, intermediate_size=64,
                                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                                     corpus_lines=300), cache_root=pathlib.Path(sys.argv[1]))
print("built", jax.process_index(), (d / "config.json").exists())
"""


@pytest.mark.parametrize("delay", [0.0, 8.0])
@pytest.mark.slow  # > 30 s: CI's slow stage
def test_every_process_builds_the_tiny_model_in_step(tmp_path, delay):
  """build_tiny_model in a 2-process job (the trainer's first act): the processes decide
  together whether the cache holds it, so the collective export is entered by both. Before,
  a process that looked after process 0 had written it returned at once and left process 0
  waiting in the export's barrier (delay 8 s: hung)."""
  outs = run_processes(TINY_WORKER, tmp_path, processes=2, devices=1,
                       args=[str(tmp_path / "cache"), str(delay)], timeout=180)
  assert [o.strip().splitlines()[-1] for o in outs] == ["built 0 True", "built 1 True"]
  # the same model a single process builds (the cache key does not know the process count)
  from posttrain_jax.models.tiny import TinyModelConfig, build_tiny_model
  t = TinyModelConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, corpus_lines=300)
  one = build_tiny_model(t, cache_root=tmp_path / "single")
  two = tmp_path / "cache" / one.name
  a, b = hf_io.load_hf_model(one), hf_io.load_hf_model(two)
  for (na, x), (nb, y) in zip(hf_io.hf_tensors(a), hf_io.hf_tensors(b)):
    assert na == nb
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=na)
  assert (one / "tokenizer.json").read_text() == (two / "tokenizer.json").read_text()
