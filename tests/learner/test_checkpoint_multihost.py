"""Checkpoints of a 2-process job (2 CPU devices each): every process gets its own side-car back.

Before, orbax wrote the JSON side-car from process 0 only, so on resume every process read
process 0's data-iterator and rollout state (process 1 then failed the task-bank fingerprint or
re-ran process 0's tasks). The worker saves a state sharded over both processes with a side-car
that differs per process, restores it (and reads the side-car alone) in a new Checkpointer, and
reports what it got; a 1-process job on the same directory is refused by name.
"""
import json
import subprocess
import sys

from tests.support.distributed import ROOT, run_processes

WORKER = r"""
import json, pathlib, sys
import jax
from posttrain_jax import sharding
sharding.initialize_distributed()
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from posttrain_jax.checkpoint import CheckpointConfig, Checkpointer
from posttrain_jax.multihost import put_global
from posttrain_jax.types import TrainState

directory = pathlib.Path(sys.argv[1])
me = jax.process_index()
mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=-1, tensor=1))
rows = NamedSharding(mesh, P("fsdp"))
w = jax.make_array_from_callback((8, 3), rows, lambda i: np.arange(24.0).reshape(8, 3)[i])
rep = NamedSharding(mesh, P())    # as the Learner commits them
state = put_global(TrainState(params={"w": w}, opt_state={"m": w * 0},
                              step=jnp.zeros((), jnp.int32), rng=jax.random.key(0)),
                   TrainState(params={"w": rows}, opt_state={"m": rows}, step=rep, rng=rep))
for async_save in (False, True):
  d = directory / ("async" if async_save else "sync")
  ckpt = Checkpointer(d, CheckpointConfig(async_save=async_save))
  ckpt.save(1, state, {"step": 1, "tasks_state": f"shard-{me}", "queue": list(range(me + 1))})
  ckpt.save(2, state, {"step": 2, "tasks_state": f"shard-{me}-later", "queue": [me] * 3})
  ckpt.close()
  again = Checkpointer(d)
  restored, extra = again.restore(state)
  back = np.asarray(jax.experimental.multihost_utils.process_allgather(restored.params["w"],
                                                                      tiled=True))
  print(json.dumps({"proc": me, "async": async_save, "extra": extra,
                    "extra_1": again.read_extra(1), "w_equal": bool((back == np.arange(24.0)
                                                                     .reshape(8, 3)).all())}))
  again.close()
"""

SINGLE = r"""
import pathlib, sys
from posttrain_jax.checkpoint import Checkpointer
Checkpointer(pathlib.Path(sys.argv[1]) / "sync").read_extra(2)
"""


def test_every_process_resumes_its_own_side_car(tmp_path):
  outs = run_processes(WORKER, tmp_path, processes=2, devices=2, args=[str(tmp_path / "c")],
                       timeout=240)
  reports = [json.loads(line) for out in outs for line in out.strip().splitlines()]
  assert len(reports) == 4, outs
  for r in reports:
    me = r["proc"]
    assert r["w_equal"]
    assert r["extra"] == {"step": 2, "tasks_state": f"shard-{me}-later", "queue": [me] * 3}, r
    assert r["extra_1"] == {"step": 1, "tasks_state": f"shard-{me}", "queue": list(range(me + 1))}
  # on disk: one side-car holding both processes' entries, in process order
  side_car = json.loads((tmp_path / "c" / "sync" / "2" / "extra" / "metadata").read_text())
  assert side_car["process_count"] == 2
  assert [e["tasks_state"] for e in side_car["per_process"]] == ["shard-0-later", "shard-1-later"]


def test_a_different_process_count_is_refused_by_name(tmp_path):
  run_processes(WORKER, tmp_path, processes=2, devices=2, args=[str(tmp_path / "c")],
                timeout=240)
  out = subprocess.run([sys.executable, "-c", SINGLE, str(tmp_path / "c")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
                            "PATH": "/usr/bin:/bin"})
  assert out.returncode != 0
  assert "was written by 2 process(es) and this job has 1" in out.stderr, out.stderr[-2000:]
