"""save_hf_model in a 2-process job (4 CPU devices each), parameters sharded over fsdp across
both processes: every process gathers, only process 0 writes, every process returns after
the files exist, and a failed write raises on every process and leaves nothing behind."""
import json

import numpy as np
import pytest

from posttrain_jax import sharding as shd
from posttrain_jax.models import hf_io
from tests.distributed_testing import run_processes
from tests.learner_testing import CFG

MODEL = CFG.replace(tie_word_embeddings=False)  # hidden 32: fsdp=8 divides "embed"

WORKER = r"""
import json, pathlib, sys
import jax
from posttrain_jax import sharding
sharding.initialize_distributed()
from flax import nnx
from posttrain_jax.models import hf_io
from tests.learner_testing import CFG

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
