"""Micro-batch layout: train-step time with contiguous vs interleaved micro-batches, sharded.

Rows are sharded over (data, fsdp) in contiguous blocks. Contiguous micro-batches (rows
k·B/M ... (k+1)·B/M - 1, the layout before issue S item 2) each sit on 1/M of the devices, so
XLA all-gathers every micro-batch onto every device; interleaved ones (row r of micro-batch k
is row r·M + k, `learner.split_micro_batches`) have B/(M·devices) rows on every device.
Both learners run the same batch on the same mesh, measured alternately in one run (these
machines are noisy); the contiguous one is `split_micro_batches` with the old reshape swapped
in while its step is traced. Also reported: all-gathers in each compiled step, and the loss
(equal: the layouts only reorder rows).

    python benchmarks/micro_batch_layout.py --out /tmp/micro.json [--smoke]
ends with `RESULT contiguous_step_s=... interleaved_step_s=... speedup=...`. `--smoke`: the same
two learners on the same 8-device mesh at the smallest size (16 rows x 32 tokens in 2
micro-batches: one row per device per micro-batch; d=64, 1 layer, vocab 256; 1 repeat):
seconds, for CI; its figures are not headline figures.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import time
from unittest import mock

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from posttrain_jax import batching, sharding  # noqa: E402
from posttrain_jax import learner as L  # noqa: E402
from posttrain_jax.models import hf_io  # noqa: E402
from posttrain_jax.models.config import ModelConfig  # noqa: E402
from posttrain_jax.types import TrainBatch, Trajectory  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))
from benchmarks._meta import run_info, write_result  # noqa: E402

_interleaved = L.split_micro_batches


def _contiguous(batch: TrainBatch, m: int) -> TrainBatch:
  """The old layout (split_micro_batches before issue S item 2): micro-batch k is rows
  k·B/m ... (k+1)·B/m - 1."""
  rows = batch.input_ids.shape[0]
  split = lambda name, x: (x if x is None or name == "seq_valid"
                           else x.reshape(m, rows // m, *x.shape[1:]))
  stacked = TrainBatch(**{f.name: split(f.name, getattr(batch, f.name))
                          for f in dataclasses.fields(batch)})
  valid = jax.vmap(lambda b: L._present_sequences(
      dataclasses.replace(b, seq_valid=batch.seq_valid)))(
          dataclasses.replace(stacked, seq_valid=jax.numpy.broadcast_to(
              batch.seq_valid, (m, batch.num_seqs))))
  return dataclasses.replace(stacked, seq_valid=valid)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True, help="write the figures here (JSON)")
  ap.add_argument("--rows", type=int, default=32)
  ap.add_argument("--seq-len", type=int, default=128)
  ap.add_argument("--micro_batches", type=int, default=4)
  ap.add_argument("--hidden", type=int, default=256)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--vocab", type=int, default=4096)
  ap.add_argument("--loss", default="sft", help="a registered loss (sft, grpo, ...)")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--smoke", action="store_true",
                  help="16 rows x 32 tokens in 2 micro-batches, d=64, 1 layer, vocab 256, "
                       "1 repeat: seconds, for CI")
  args = ap.parse_args()
  info = run_info(smoke=args.smoke)
  if args.smoke:
    args.rows, args.seq_len, args.micro_batches = 16, 32, 2
    args.hidden, args.layers, args.vocab, args.repeats = 64, 1, 256, 1

  mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=-1))
  cfg = ModelConfig(family="llama", vocab_size=args.vocab, hidden_size=args.hidden,
                    intermediate_size=3 * args.hidden, num_layers=args.layers,
                    num_heads=args.hidden // 64, num_kv_heads=args.hidden // 64, head_dim=64,
                    tie_word_embeddings=False)
  b, t, m = args.rows, args.seq_len, args.micro_batches
  rng = np.random.default_rng(0)
  trajs = [Trajectory(id=str(i), task_id=str(i), token_ids=rng.integers(0, cfg.vocab_size, t + 1).tolist(),
                      loss_mask=[0] * 16 + [1] * (t + 1 - 16),
                      behaviour_logprobs=[0.0] * 16 + (-rng.random(t + 1 - 16)).tolist(),
                      policy_version=[0] * (t + 1)) for i in range(b)]
  batch = batching.build_batch(trajs, rng.normal(size=b).tolist(),
                               batching.BatchConfig(rows=b, seq_len=t, max_seqs=b, pack=False))
  lcfg = L.LearnerConfig(loss=args.loss, micro_batches=m)

  runs = {}
  for name, split in (("contiguous", _contiguous), ("interleaved", _interleaved)):
    learner = L.Learner(hf_io.init_model(cfg, 0, mesh), lcfg, mesh=mesh)
    put = learner.put_batch(batch)
    with mock.patch.object(L, "split_micro_batches", split):   # read when the step is traced
      hlo = learner._step.lower(learner.state, put, None).compile().as_text()
      loss = learner.step(batch)["loss"]
    runs[name] = {"learner": learner, "put": put, "times": [], "loss": loss,
                  "all_gathers": hlo.count("all-gather-start") or hlo.count("all-gather(")}

  def one(r):
    t0 = time.perf_counter()
    r["learner"].state, metrics = r["learner"]._step(r["learner"].state, r["put"], None)
    jax.block_until_ready(metrics["loss"])
    r["times"].append(time.perf_counter() - t0)

  for _ in range(args.repeats):   # alternate, so drift on a shared machine hits both alike
    for r in runs.values():
      one(r)

  rows = {name: {"step_s": min(r["times"]), "step_s_median": float(np.median(r["times"])),
                 "all_gathers": r["all_gathers"], "first_loss": r["loss"]}
          for name, r in runs.items()}
  print(f"model: {cfg.num_params() / 1e6:.1f}M params, {b} rows x {t} tokens in {m} micro-batches, "
        f"mesh {dict(mesh.shape)}, loss {args.loss}")
  print(f"{'layout':<12} {'step s':>8} {'median s':>9} {'all-gathers':>12} {'first loss':>11}")
  for name, r in rows.items():
    print(f"{name:<12} {r['step_s']:>8.3f} {r['step_s_median']:>9.3f} {r['all_gathers']:>12d} "
          f"{r['first_loss']:>11.5f}")
  c, i = rows["contiguous"]["step_s"], rows["interleaved"]["step_s"]
  write_result(args.out, info, {"rows": b, "seq_len": t, "micro_batches": m,
                                "mesh": dict(mesh.shape), "params": cfg.num_params(), **rows})
  print(f"RESULT contiguous_step_s={c:.3f} interleaved_step_s={i:.3f} speedup={c / i:.2f}")


if __name__ == "__main__":
  main()
