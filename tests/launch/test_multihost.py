"""Launching past one process: launch/local.py, cluster detection, and a real 2-process run.

- launch/local.py starts N processes with the job's environment, prefixes their output, stops
  the others when one fails (exit status passed on) and passes SIGTERM on;
- a process started as one task of a SLURM / Open MPI / TPU-pod job without --distributed is
  refused (N lone copies would each train alone into one workdir);
- (slow) launch/train.py as a 2-process job through launch/local.py: stopped after a
  checkpoint, rerun with the same command, every process resumes from its own side-car and
  the run finishes with its RESULT line; the task-bank shards differ between processes.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from posttrain_jax.sharding import cluster_environment

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOCAL = [sys.executable, str(ROOT / "launch/local.py")]


def _env(**extra):
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_", "SLURM_", "OMPI_", "TPU_"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **extra)
  return env


def test_cluster_environment_names_the_job():
  assert cluster_environment({}) is None
  assert cluster_environment({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None   # one task
  assert cluster_environment({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}) == ("SLURM", 4)
  assert cluster_environment({"OMPI_COMM_WORLD_SIZE": "2"}) == ("Open MPI", 2)
  assert cluster_environment({"TPU_WORKER_HOSTNAMES": "a,b,c,d"}) == ("Cloud TPU pod slice", 4)
  assert cluster_environment({"JAX_NUM_PROCESSES": "2"}) == ("JAX_NUM_PROCESSES", 2)


def test_train_refuses_to_run_as_lone_copies_of_a_cluster_job(tmp_path):
  out = subprocess.run([sys.executable, str(ROOT / "launch/train.py"), f"--workdir={tmp_path}"],
                       env=_env(SLURM_JOB_ID="7", SLURM_NTASKS="2"), capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
  assert out.returncode == 1
  assert out.stderr.strip().splitlines()[-1] == (
      "error: this process is one of 2 tasks of a SLURM job: pass --distributed to join them "
      "into one training job")
  assert not any(tmp_path.iterdir())   # nothing written


WHO = ("import os, sys, time; i = int(os.environ['JAX_PROCESS_ID']); "
       "print('proc', i, 'of', os.environ['JAX_NUM_PROCESSES'], "
       "os.environ['JAX_COORDINATOR_ADDRESS'].split(':')[0], os.environ['XLA_FLAGS'], flush=True); "
       "time.sleep(float(sys.argv[1]) if i == 0 else 0); sys.exit(int(sys.argv[2]) if i == 1 else 0)")


def test_local_launcher_runs_every_process_with_its_environment():
  out = subprocess.run([*LOCAL, "--processes=3", "--devices_per_process=4", "--",
                        sys.executable, "-c", WHO, "0", "0"], env=_env(), capture_output=True,
                       text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  flags = "--xla_force_host_platform_device_count=4"
  assert sorted(out.stdout.splitlines()) == [
      f"[p{i}] proc {i} of 3 127.0.0.1 {flags}" for i in range(3)]


def test_local_launcher_stops_the_others_when_one_fails():
  t0 = time.monotonic()
  out = subprocess.run([*LOCAL, "--processes=2", "--grace_s=5", "--", sys.executable, "-c", WHO,
                        "120", "3"], env=_env(), capture_output=True, text=True, timeout=60)
  assert out.returncode == 3
  assert time.monotonic() - t0 < 30           # process 0 (sleeping 120 s) was stopped
  assert "process 1 exited with status 3; stopping the others" in out.stderr


def test_local_launcher_passes_sigterm_on(tmp_path):
  code = ("import signal, sys, time, os\n"
          "def bye(*a):\n  print('term', os.environ['JAX_PROCESS_ID'], flush=True); sys.exit(0)\n"
          "signal.signal(signal.SIGTERM, bye)\nprint('ready', flush=True)\ntime.sleep(60)\n")
  proc = subprocess.Popen([*LOCAL, "--processes=2", "--", sys.executable, "-c", code], env=_env(),
                          stdout=subprocess.PIPE, text=True)
  ready = 0
  while ready < 2:
    ready += "ready" in proc.stdout.readline()
  proc.send_signal(signal.SIGTERM)
  rest, _ = proc.communicate(timeout=30)
  assert proc.returncode == 0
  assert sorted(line for line in rest.splitlines() if "term" in line) == ["[p0] term 0",
                                                                          "[p1] term 1"]


FLAGS = ["--config.sft.steps=4", "--config.sft.batch_size=8", "--config.sft.batch.rows=8",
         "--config.sft.batch.max_seqs=8", "--config.rl.steps=2", "--config.rl.prompts_per_step=4",
         "--config.rl.rollout.group_size=4", "--config.rl.batch.rows=16",
         "--config.rl.batch.max_seqs=16", "--config.eval.every_steps=0",
         "--config.tasks.eval_size=16", "--config.checkpoint.every_steps=2"]


@pytest.mark.slow
def test_a_two_process_training_run_stops_and_resumes_on_every_process(tmp_path):
  cmd = [*LOCAL, "--processes=2", "--devices_per_process=2", "--", sys.executable,
         str(ROOT / "launch/train.py"), f"--workdir={tmp_path}", *FLAGS]
  first = subprocess.run([*cmd, "--config.stop_after_step=3"], env=_env(), capture_output=True,
                         text=True, timeout=900)
  assert first.returncode == 0, first.stdout[-3000:]
  side_car = json.loads((tmp_path / "checkpoints/2/extra/metadata").read_text())
  shards = [e["tasks_state"] for e in side_car["per_process"]]
  assert side_car["process_count"] == 2 and shards[0] != shards[1]   # each its own position
  second = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=900)
  assert second.returncode == 0, second.stdout[-3000:]
  lines = second.stdout.splitlines()
  for i in range(2):
    assert any(line.startswith(f"[p{i}] resumed from") and line.endswith("(step 2)")
               for line in lines), second.stdout[-3000:]
  assert lines[-1].startswith("RESULT heldout_before=")
  rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "data/hash" in r] == [1, 2, 3, 4, 5, 6]


_REFUSE_FLEET = """
import sys
from posttrain_jax import sharding
sharding.initialize_distributed()
from posttrain_jax.config_io import ConfigTypeError
from posttrain_jax.run import Trainer
from tests.support.runs import tiny_run
rl = {"steps": 2, "prompts_per_step": 2, "engine": "fleet",
      "engine_config": {"urls": ["http://127.0.0.1:9"], "server": {"weights_dir": sys.argv[1]}},
      "rollout": {"group_size": 4, "max_tokens": 4}, "learner": {"loss": "grpo"},
      "batch": {"rows": 8, "seq_len": 32, "max_seqs": 8, "pack": False}}
try:
  Trainer(tiny_run(sys.argv[1] + "/run", sft={"steps": 0}, rl=rl), log=lambda *_: None)
  print("not refused")
except ConfigTypeError as e:
  print("refused:", e)
"""


def test_a_fleet_is_refused_with_several_processes(tmp_path):
  """Each process would push its weights to, and route over, every server of the fleet."""
  from tests.support.distributed import run_processes
  outs = run_processes(_REFUSE_FLEET, ROOT, args=[str(tmp_path)], timeout=240)
  for out in outs:
    last = out.strip().splitlines()[-1]
    assert last.startswith("refused:") and "one-process learner" in last, out
  assert not (tmp_path / "run").exists()   # refused before anything was written
