"""The learner across processes: each process feeds its own rows, the step sees the global batch.

2 processes × 2 CPU devices, each packing only its own share of the step's trajectories,
train like 1 process × 4 devices packing all of them (two GRPO steps through rl_step, trimmed
batches, 1 and 2 micro-batches): the same parameters and loss. Before, `put_batch` handed each
process's rows to `jax.device_put` as if they were the whole batch (and a Learner could not
even be built: its fresh step counter and PRNG key were this process's arrays alone). A process
whose trajectories were all filtered out still takes part in the step (it used to skip the
collectives the other process waited in).
"""
import copy
import subprocess

import numpy as np
import pytest

from tests.support.distributed import run_processes

WORKER = r"""
import copy, sys
import jax
from posttrain_jax import sharding
sharding.initialize_distributed()
import numpy as np
from posttrain_jax import batching
from posttrain_jax.advantages import AdvantageConfig
from posttrain_jax.learner import Learner, LearnerConfig, OptimizerConfig
from posttrain_jax.models import hf_io
from posttrain_jax.run.rl_step import rl_step
from tests.support.learner import CFG, random_trajectories

layout, micro, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
n, me = jax.process_count(), jax.process_index()
trajs = random_trajectories(16, seed=3)                     # 4 groups of 4
if layout == "split":        # whole groups per process: g0, g2 | g1, g3
  mine = [t for t in trajs if int(t.group_id[1:]) % n == me]
elif layout == "empty":      # process 1's rollouts all filtered out
  mine = trajs if me == 0 else []
else:
  mine = trajs

class Fixed:
  def update_weights(self, params, version): pass
  def collect(self, step): return [], copy.deepcopy(mine)
  def metrics(self): return {}

mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=-1, tensor=1))
learner = Learner(hf_io.init_model(CFG, 0, mesh),
                  LearnerConfig(loss="grpo", micro_batches=micro,
                                optimizer=OptimizerConfig(learning_rate=1e-2)), mesh=mesh)
rows = 16 if layout in ("whole", "empty") else 8
cfg = batching.BatchConfig(rows=rows, seq_len=16, max_seqs=16, pack=False, trim=True)
losses = []
for step in range(2):
  res = rl_step(learner, Fixed(), advantage=AdvantageConfig(), step=step, version=step,
                batch_cfg=cfg)
  losses.append(res.metrics["loss"])
flat = [np.asarray(jax.experimental.multihost_utils.process_allgather(x, tiled=True))
        for x in jax.tree.leaves(learner.params)]
lp = learner.logprobs(batching.build_batch(mine, [0.0] * len(mine), cfg))  # a collective
if me == 0:
  np.savez(out, losses=np.asarray(losses), *flat)
print("done", me, lp.shape)
"""


def _run(tmp_path, layout, micro, processes, devices):
  out = tmp_path / f"{layout}_{micro}_{processes}.npz"
  logs = run_processes(WORKER, tmp_path, processes=processes, devices=devices,
                       args=[layout, str(micro), str(out)], timeout=300)
  data = np.load(out)
  return data["losses"], [data[f"arr_{i}"] for i in range(len(data.files) - 1)], logs


@pytest.mark.parametrize("micro", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_two_processes_feeding_their_own_rows_train_like_one(tmp_path, micro):
  one_loss, one, _ = _run(tmp_path, "whole", micro, processes=1, devices=4)
  two_loss, two, logs = _run(tmp_path, "split", micro, processes=2, devices=2)
  np.testing.assert_allclose(two_loss, one_loss, rtol=1e-5)
  # Adam turns a ~1e-9 gradient difference (another summation order) into ~1e-6 of a 1e-2
  # step where a gradient is ~0; a wrong batch moves the weights by ~1e-2
  for a, b in zip(one, two):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
  # logprobs hands each process its own rows back: 8 trajectories, 8 rows
  assert [line.split()[-2:] for line in (o.strip().splitlines()[-1] for o in logs)] == \
      [["(8,", "16)"], ["(8,", "16)"]]   # rows = 8 per process


@pytest.mark.slow  # > 30 s: CI's slow stage
def test_a_process_that_kept_nothing_still_takes_part(tmp_path):
  one_loss, one, _ = _run(tmp_path, "whole", 1, processes=1, devices=4)
  two_loss, two, _ = _run(tmp_path, "empty", 1, processes=2, devices=2)
  np.testing.assert_allclose(two_loss, one_loss, rtol=1e-5)
  for a, b in zip(one, two):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
