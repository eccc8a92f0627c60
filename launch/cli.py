"""What every absl entry point of launch/ shares: `--config=<file>` with `--config.<field>=value`
overrides, and every mistake in them raised as one UserError that names the field."""
import difflib
import os
import re
from typing import Callable, Optional

from absl import flags, logging
from ml_collections import config_dict, config_flags
from ml_collections.config_flags.config_flags import ConfigFileFlagParser

from posttrain_jax.errors import UserError

_OVERRIDE = re.compile(r"^--?(?:no)?config\.([^=]+)")


def _config_arg(argv: list[str], default: str) -> str:
  """The value of `--config` in argv (a path, optionally `:<argument>`), else the default."""
  config_arg = default
  for i, arg in enumerate(argv):
    if arg.startswith(("--config=", "-config=")):
      config_arg = arg.split("=", 1)[1]
    elif arg in ("--config", "-config") and i + 1 < len(argv):
      config_arg = argv[i + 1]
  return config_arg


def _unknown_override(argv: list[str], default: str) -> Optional[str]:
  """The first `--config.<path>` in argv that names no field of the config, as a message."""
  try:
    config = ConfigFileFlagParser(name="config").parse(_config_arg(argv, default))
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


def flags_parser(default: str) -> Callable[[list[str]], list[str]]:
  """absl's `flags_parser` for app.run, with `default` as the config file when none is given."""
  return lambda argv: _parse_flags(argv, default)


def _parse_flags(argv: list[str], default: str,
                 flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
  """absl's flag parsing, with a mistake in the flags raised as a UserError.

  ml_collections applies the `--config.<field>` overrides while the `--config` flag is defined
  (default config file) or parsed (`--config=<file>`), so the flag is defined here, not at
  import. absl's app.run turns an unset --verbosity into INFO after this parser returns
  (marking it set, so `main` cannot tell); setting WARNING here keeps it. `flag_values`: a
  fresh `flags.FlagValues()` parses without touching the process's flags (tests).
  """
  config_arg = _config_arg(argv, default)
  if not os.path.isfile(config_arg.split(":", 1)[0]):
    raise UserError(f"--config={config_arg}: no such file")
  try:
    config_flags.DEFINE_config_file("config", default, "Experiment config file.",
                                    flag_values=flag_values, sys_argv=argv)
    rest = flag_values(argv)
  except flags.Error as e:  # one line even when the value holds a newline
    raise UserError(f"{e} (--helpfull lists the flags)".replace("\n", "\\n")) from None
  except (KeyError, AttributeError, TypeError, ValueError):
    # ml_collections' lookup of an unknown override: KeyError / AttributeError for a missing
    # field, TypeError below a string field, ValueError below a field that is None
    problem = _unknown_override(argv, default)
    if problem is None:
      raise
    raise UserError(problem.replace("\n", "\\n")) from None
  if flag_values is not flags.FLAGS:
    return rest
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
    # transformers warns at import that PyTorch is missing; we never use its torch models.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM has its own logger setting
  return rest


DEFAULT_COMPILE_CACHE = "~/.cache/posttrain_jax/xla"


def use_compile_cache(path: str) -> None:
  """Keeps XLA's compiled programs in JAX's persistent compilation cache at `path` ('' = off),
  so a rerun, a resume after preemption, or another run of the same shapes loads its programs
  instead of compiling them again (a short default run: 78 s cold, 38 s warm on 2 busy cores).
  Every program is kept, however fast it compiled: a short run's compiles are many small ones.
  JAX_COMPILATION_CACHE_DIR, where set, wins (the tests point every process at one cache)."""
  if not path or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return
  import jax
  jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

