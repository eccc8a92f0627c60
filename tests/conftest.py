"""Test-wide setup: 8 host devices so sharding tests run on CPU, float32 matmuls exact.

The device count is appended to an `XLA_FLAGS` the caller already set (e.g. another XLA
flag), unless that names a device count itself. Tests marked `@pytest.mark.devices(n)` need n
devices. Fewer devices FAIL them where the count was ours to give -- CPU with our flag -- or
under CI (`CI` set), since the tests would otherwise vanish as silent skips; they skip only
where the caller chose the devices (their own device-count flag, or a GPU/TPU platform).

`PTJ_SLOW_DEADLINE` (Unix seconds; CI's slow stage sets it so the whole CI stays within its budget):
a test marked `slow` that would start after it is skipped, with the reason saying so, and the
run ends with a line counting them, so a time-boxed stage never looks like a full one.
`PTJ_SLOW_ROTATE` (CI sets the commit): test files run in an order drawn from it (the tests of
a file stay together, in their order), so the files a time box leaves out differ from one
commit to the next instead of always being the last ones collected.

XLA's compiled programs are kept in JAX's persistent compilation cache, shared by every test
process and every pytest run on the machine (`PTJ_TEST_JAX_CACHE`, default
`$TMPDIR/ptj-jax-cache-<uid>`; `off` disables it), and by the subprocesses tests start (the
environment variable): most tests build the same tiny models, and a tiny run spends most of its
time compiling (a 20 + 4-step default run: 78 s cold, 38 s with the cache warm). The key is
the program's HLO, the compile options and the jaxlib/XLA version, so a hit is the program a
compile would have produced. A test that counts XLA compiles counts cache hits with them.
"""
import hashlib
import os
import tempfile
import time

import pytest

_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_CALLER_SET_DEVICES = _DEVICE_FLAG in os.environ.get("XLA_FLAGS", "")
if not _CALLER_SET_DEVICES:
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
_JAX_CACHE = os.environ.get("PTJ_TEST_JAX_CACHE") or os.path.join(
    tempfile.gettempdir(), f"ptj-jax-cache-{os.getuid()}")
if _JAX_CACHE != "off":
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _JAX_CACHE)
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
  config.addinivalue_line("markers", "devices(n): needs n JAX devices (8 CPU devices by default; "
                                     "fewer fail on CPU and under CI, skip elsewhere)")


def pytest_collection_modifyitems(config, items):
  """PTJ_SLOW_ROTATE (module docstring): whole files in an order drawn from the value; the
  same on every xdist worker, as xdist requires."""
  seed = os.environ.get("PTJ_SLOW_ROTATE")
  if seed:   # a stable sort: a file's tests keep their order
    items.sort(key=lambda item: hashlib.sha256(
        f"{seed}:{item.nodeid.split('::', 1)[0]}".encode()).hexdigest())


_BUDGET_REASON = "not run: the slow stage's time budget (PTJ_SLOW_DEADLINE={}) is spent"


def pytest_runtest_setup(item):
  deadline = os.environ.get("PTJ_SLOW_DEADLINE")
  if deadline and item.get_closest_marker("slow") and time.time() > float(deadline):
    pytest.skip(_BUDGET_REASON.format(deadline))
  marker = item.get_closest_marker("devices")
  if marker is None:
    return
  need, have = marker.args[0], jax.device_count()
  if have >= need:
    return
  ours = jax.default_backend() == "cpu" and not _CALLER_SET_DEVICES
  message = (f"needs {need} devices, found {have} {jax.default_backend()} device(s) "
             f"(XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})")
  if ours or os.environ.get("CI"):
    pytest.fail(message, pytrace=False)
  pytest.skip(message)


def pytest_terminal_summary(terminalreporter):
  """Counts the budget's skips from the reports, so xdist workers' skips are counted too."""
  marker = _BUDGET_REASON.split("{")[0]
  skipped = [r.nodeid for r in terminalreporter.stats.get("skipped", [])
             if isinstance(r.longrepr, tuple) and marker in str(r.longrepr[-1])]
  if skipped:
    terminalreporter.write_line(
        f"{len(skipped)} slow test(s) NOT RUN for lack of CI time (PTJ_SLOW_DEADLINE): "
        + ", ".join(skipped))
