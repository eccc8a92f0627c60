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
"""
import difflib
import os
import pathlib
import re
import shutil
import sys
from typing import Optional

from absl import app, flags, logging
from ml_collections import config_dict, config_flags
from ml_collections.config_flags.config_flags import ConfigFileFlagParser

from posttrain_jax.errors import UserError

_DEFAULT = pathlib.Path(__file__).resolve().parent.parent / "configs" / "default.py"
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (overrides config.workdir).")
_RESUME = flags.DEFINE_bool("resume", True, "Resume from the latest checkpoint in the workdir.")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False,
                                 "Join a multi-process JAX job (JAX_COORDINATOR_ADDRESS etc.).")
_OVERRIDE = re.compile(r"^--?(?:no)?config\.([^=]+)")


def _config_arg(argv: list[str]) -> str:
  """The value of `--config` in argv (a path, optionally `:<argument>`), else the default."""
  config_arg = str(_DEFAULT)
  for i, arg in enumerate(argv):
    if arg.startswith(("--config=", "-config=")):
      config_arg = arg.split("=", 1)[1]
    elif arg in ("--config", "-config") and i + 1 < len(argv):
      config_arg = argv[i + 1]
  return config_arg


def _unknown_override(argv: list[str]) -> Optional[str]:
  """The first `--config.<path>` in argv that names no field of the config, as a message."""
  try:
    config = ConfigFileFlagParser(name="config").parse(_config_arg(argv))
  except Exception:  # the config file itself is broken: the caller re-raises the original error
    return None
  for arg in argv:
    match = _OVERRIDE.match(arg)
    if not match:
      continue
    path = match.group(1).split(".")
    node = config
    for depth, key in enumerate(path):
      where = ".".join(["config", *path[:depth]])
      if not isinstance(node, (config_dict.ConfigDict, dict)):
        return f"--config.{match.group(1)}: {where} = {node!r} has no fields"
      if key not in node:
        close = difflib.get_close_matches(key, list(node.keys()), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"its fields: {sorted(node.keys())}"
        return f"--config.{match.group(1)}: {where} has no field {key!r}; {hint}"
      node = node[key]
  return None


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a mistake in the flags raised as a UserError.

  ml_collections applies the `--config.<field>` overrides while the `--config` flag is defined
  (default config file) or parsed (`--config=<file>`), so the flag is defined here, not at
  import. absl's app.run turns an unset --verbosity into INFO after this parser returns
  (marking it set, so `main` cannot tell); setting WARNING here keeps it.
  """
  config_arg = _config_arg(argv)
  if not os.path.isfile(config_arg.split(":", 1)[0]):
    raise UserError(f"--config={config_arg}: no such file")
  try:
    config_flags.DEFINE_config_file("config", str(_DEFAULT), "Experiment config file.")
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    raise UserError(f"{e} (--helpfull lists the flags)") from None
  except (KeyError, AttributeError):  # ml_collections' lookup of an unknown override
    problem = _unknown_override(argv)
    if problem is None:
      raise
    raise UserError(problem) from None
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
    # transformers warns at import that PyTorch is missing; we never use its torch models.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM has its own logger setting
  return rest


def main(argv):
  if len(argv) > 1:
    raise UserError(f"unexpected argument(s) {argv[1:]}; flags look like --config.sft.steps=20")
  from posttrain_jax import sharding
  if _DISTRIBUTED.value:
    sharding.initialize_distributed()
  from posttrain_jax.run_config import run_config_from_dict
  from posttrain_jax.trainer import Trainer, result_line

  raw = flags.FLAGS.config.to_dict()
  if _WORKDIR.value:
    raw["workdir"] = _WORKDIR.value
  cfg = run_config_from_dict(raw)
  if not _RESUME.value:
    shutil.rmtree(pathlib.Path(cfg.workdir) / "checkpoints", ignore_errors=True)
  result = Trainer(cfg).run()
  if result is None:
    print(f"stopped at step {cfg.stop_after_step}; rerun with the same --workdir to resume")
    return
  print(f"workdir: {cfg.workdir} (metrics.jsonl, plot.png, final_model/)")
  print(result_line(result))


if __name__ == "__main__":
  try:
    app.run(main, flags_parser=_parse_flags)
  except UserError as e:
    sys.exit(f"error: {e}")
