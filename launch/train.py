"""Train: `python launch/train.py [--config=configs/<name>.py] [--config.<field>=value ...]`.

With no flags it runs configs/default.py: a tiny model built locally, SFT warm-start, then
GRPO with the embedded sampler on synthetic arithmetic. `--workdir` is where checkpoints,
metrics.jsonl, tensorboard/ and plot.png go; rerunning with the same workdir resumes
(`--noresume` starts over). Ends with one line
`RESULT heldout_before=... heldout_after=... reward_first10=... reward_last10=... minutes=...`.
"""
import pathlib
import shutil
import sys

from absl import app, flags
from ml_collections import config_flags

_DEFAULT = pathlib.Path(__file__).resolve().parent.parent / "configs" / "default.py"
_CONFIG = config_flags.DEFINE_config_file("config", str(_DEFAULT), "Experiment config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (overrides config.workdir).")
_RESUME = flags.DEFINE_bool("resume", True, "Resume from the latest checkpoint in the workdir.")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False,
                                 "Join a multi-process JAX job (JAX_COORDINATOR_ADDRESS etc.).")


def main(argv):
  del argv
  from absl import logging
  if not flags.FLAGS.is_parsed() or flags.FLAGS["verbosity"].using_default_value:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  from posttrain_jax import sharding
  if _DISTRIBUTED.value:
    sharding.initialize_distributed()
  from posttrain_jax.config_io import ConfigTypeError
  from posttrain_jax.run_config import run_config_from_dict
  from posttrain_jax.trainer import Trainer, result_line

  raw = _CONFIG.value.to_dict()
  if _WORKDIR.value:
    raw["workdir"] = _WORKDIR.value
  try:
    cfg = run_config_from_dict(raw)
  except ConfigTypeError as e:
    sys.exit(f"bad config: {e}")
  if not _RESUME.value:
    shutil.rmtree(pathlib.Path(cfg.workdir) / "checkpoints", ignore_errors=True)
  result = Trainer(cfg).run()
  if result is None:
    print(f"stopped at step {cfg.stop_after_step}; rerun with the same --workdir to resume")
    return
  print(f"workdir: {cfg.workdir} (metrics.jsonl, plot.png, final_model/)")
  print(result_line(result))


if __name__ == "__main__":
  app.run(main)
