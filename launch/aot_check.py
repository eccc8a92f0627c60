"""AOT memory check: `python launch/aot_check.py --config=configs/qwen3.py:8b,h200x8`.

Compiles the config's RL train step against abstract shapes on its mesh (no weights are read
or allocated; posttrain_jax/aot.py) and prints per-device memory by part against the device's
capacity, ending with one line `RESULT per_device_gb=... capacity_gb=... fits=<0|1>` (GiB).
A config that does not fit ends with `error: does not fit: ...` (each part's GiB and the
capacity) and exit status 1.

Devices: on a machine with the slice's accelerators the real ones. Elsewhere fake CPU devices,
as many as `--num_devices` or the slice named in the config argument (configs/_real.py: h200x8,
h100x8, v5e8, v5p64) says; their capacity is the flag `--device_memory_gb`, else the slice's (or
`--device_kind`'s) device memory (H200 141, H100 80, v5e 16, v5p 95). On CPU the memory-
minimising scheduler is used (`--xla_cpu_enable_concurrency_optimized_scheduler=false`): XLA's
default CPU scheduler runs rematerialised forward passes early and keeps every layer's
activations live, so remat would save nothing in the numbers.
"""
import os
import pathlib
import sys

from absl import app, flags

from posttrain_jax.errors import UserError
from posttrain_jax.launch.cli import _config_arg, flags_parser

_DEFAULT = pathlib.Path(__file__).resolve().parent.parent / "configs" / "qwen3.py"
_MEMORY = flags.DEFINE_float("device_memory_gb", None,
                             "Memory per device, GiB (default: the device kind's).")
_KIND = flags.DEFINE_enum("device_kind", None, ["h200", "h100", "v5e", "v5p"],
                          "Target device kind (default: the real device's, else the slice's).")
_NUM = flags.DEFINE_integer("num_devices", None,
                            "Fake CPU devices (default: the slice's device count, else 8).")


def _fake_devices(argv: list[str]) -> None:
  """Before JAX starts: the CPU device count and the memory-minimising CPU scheduler."""
  from posttrain_jax.configs._real import SLICES, slice_of
  arg = _config_arg(argv, str(_DEFAULT))
  name = slice_of(arg.split(":", 1)[1]) if ":" in arg else None
  count = _NUM.value or (SLICES[name][0] if name else 8)
  xla = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in xla:
    xla += f" --xla_force_host_platform_device_count={count}"
  if "xla_cpu_enable_concurrency_optimized_scheduler" not in xla:
    xla += " --xla_cpu_enable_concurrency_optimized_scheduler=false"
  os.environ["XLA_FLAGS"] = xla.strip()


def main(argv):
  if len(argv) > 1:
    raise UserError(f"unexpected argument(s) {argv[1:]}")
  _fake_devices(sys.argv)
  import jax
  from posttrain_jax import aot
  from posttrain_jax.configs._real import SLICES, slice_of
  from posttrain_jax.sharding import make_mesh

  cfg = aot.run_config_for_check(flags.FLAGS.config.to_dict())
  arg = _config_arg(sys.argv, str(_DEFAULT))
  name = slice_of(arg.split(":", 1)[1]) if ":" in arg else None
  kind = _KIND.value or aot.device_kind(jax.devices()[0]) or (SLICES[name][1] if name else None)
  if _MEMORY.value is None and kind is None:
    raise UserError(f"no device capacity: {jax.devices()[0].device_kind} has no known memory; "
                    "give --device_memory_gb (or --device_kind)")
  memory_gb = _MEMORY.value if _MEMORY.value is not None else aot.DEVICE_MEMORY_GIB[kind]
  mesh = make_mesh(cfg.mesh)
  report, compiled = aot.check(cfg, mesh, int(memory_gb * aot.GIB))
  share = aot.rollout_share(cfg)
  print(f"config {arg}: {aot.model_config_of(cfg).num_params() / 1e9:.2f}B params, mesh "
        f"{dict(mesh.shape)} on {mesh.size} {jax.devices()[0].platform} devices, target "
        f"{kind or 'given'} {memory_gb:g} GiB/device"
        + (f" less vLLM's {share:.0%}" if share else "") + f"; compiled in {compiled.seconds:.0f} s")
  print(report.table())
  print(report.result_line())
  if not report.fits:
    raise UserError(report.refusal())


if __name__ == "__main__":
  try:
    app.run(main, flags_parser=flags_parser(str(_DEFAULT)))
  except UserError as e:
    sys.exit(f"error: {e}")
