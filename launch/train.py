"""Train: `python launch/train.py [--config=configs/<name>.py] [--config.<field>=value ...]`.

With no flags it runs configs/default.py: a tiny model built locally, SFT warm-start, then
GRPO with the embedded sampler on synthetic arithmetic. `--workdir` is where checkpoints,
metrics.jsonl, tensorboard/ and plot.png go; rerunning with the same workdir resumes
(`--noresume` starts over). Ends with one line
`RESULT heldout_before=... heldout_after=... reward_first10=... reward_last10=... minutes=...`.

The console shows the progress bar, the held-out lines and the RESULT line; library logs
(orbax logs every save at INFO) stay at WARNING unless `--verbosity` is given. A mistake of
the user's (`posttrain_jax.errors.UserError`: a config field, a path, a data file, a model
directory; also a bad flag) ends the run with one `error: ...` line and exit status 1; any
other exception is a bug and shows its traceback.

SIGTERM or SIGINT (a preemption, Ctrl-C) stops the run at the next step boundary: the step in
progress finishes, a checkpoint of the current step is written, the line `preempted at step k:
checkpoint written, resume with the same command` is printed and the exit status is 0; running
the same command again resumes from that checkpoint. A second SIGTERM / SIGINT during that
shutdown ends the process at once (the signal's default action; the previous checkpoint stays).
"""
import os
import pathlib
import shutil
import signal
import sys
import threading

from absl import app, flags

from posttrain_jax.errors import UserError
from posttrain_jax.launch.cli import DEFAULT_COMPILE_CACHE, flags_parser, use_compile_cache

_DEFAULT = pathlib.Path(__file__).resolve().parent.parent / "configs" / "default.py"
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (overrides config.workdir).")
_RESUME = flags.DEFINE_bool("resume", True, "Resume from the latest checkpoint in the workdir.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Find the multi-process job from the cluster (SLURM, a TPU pod slice, "
    "Open MPI): jax.distributed's auto-detection. A job described by JAX_COORDINATOR_ADDRESS, "
    "JAX_NUM_PROCESSES and JAX_PROCESS_ID (launch/local.py) is joined without it.")
_COMPILE_CACHE = flags.DEFINE_string(
    "compile_cache", DEFAULT_COMPILE_CACHE, "XLA's compiled programs are kept here and reused "
    "by the next run of the same shapes (JAX's persistent compilation cache); '' = off.")


def _stop_on_signals(preempt: threading.Event) -> None:
  """SIGTERM / SIGINT set `preempt` once; then both get their default action back (exit now)."""
  def handler(signum, frame):
    del frame
    preempt.set()
    for s in (signal.SIGTERM, signal.SIGINT):
      signal.signal(s, signal.SIG_DFL)
    os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint "
                f"(send it again to exit at once)\n".encode())
  for s in (signal.SIGTERM, signal.SIGINT):
    signal.signal(s, handler)


def main(argv):
  if len(argv) > 1:
    raise UserError(f"unexpected argument(s) {argv[1:]}; flags look like --config.sft.steps=20")
  preempt = threading.Event()
  _stop_on_signals(preempt)   # first thing: a preemption during start-up is a clean stop too
  from posttrain_jax import sharding
  job = sharding.cluster_environment()
  if job is not None and not _DISTRIBUTED.value and "JAX_NUM_PROCESSES" not in os.environ:
    # N copies of a one-process run would each train alone and write the same workdir
    raise UserError(f"this process is one of {job[1]} tasks of a {job[0]} job: pass "
                    "--distributed to join them into one training job")
  use_compile_cache(_COMPILE_CACHE.value)
  if sharding.initialize_distributed(auto_detect=_DISTRIBUTED.value):
    import jax
    print(f"process {jax.process_index()} of {jax.process_count()} "
          f"({job[0] if job else 'jax.distributed'}): {jax.local_device_count()} of "
          f"{jax.device_count()} devices", flush=True)
  from posttrain_jax.run_config import run_config_from_dict
  from posttrain_jax.run import Trainer, result_line

  raw = flags.FLAGS.config.to_dict()
  if _WORKDIR.value:
    raw["workdir"] = _WORKDIR.value
  cfg = run_config_from_dict(raw)
  if not _RESUME.value:   # one process removes them, the others wait until it has
    import jax
    if jax.process_index() == 0:
      shutil.rmtree(pathlib.Path(cfg.workdir) / "checkpoints", ignore_errors=True)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices("posttrain_jax: --noresume")
  trainer = Trainer(cfg, preempt=preempt)
  result = trainer.run()
  if trainer.preempted_at is not None:
    return                    # the trainer printed the "preempted at step k" line
  if result is None:
    print(f"stopped at step {cfg.stop_after_step}; rerun with the same --workdir to resume")
    return
  print(f"workdir: {cfg.workdir} (metrics.jsonl, plot.png, final_model/)")
  print(result_line(result))


if __name__ == "__main__":
  try:
    app.run(main, flags_parser=flags_parser(str(_DEFAULT)))
  except UserError as e:
    sys.exit(f"error: {e}")
