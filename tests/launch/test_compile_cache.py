"""`--compile_cache` (launch/cli.py `use_compile_cache`): a second process with the same cache
loads the first one's programs instead of compiling them (JAX's persistent compilation cache,
counted by jax.monitoring), and '' turns it off. Each process runs with no
JAX_COMPILATION_CACHE_DIR, so the flag's own path is what is exercised."""
import json
import os
import subprocess
import sys

import pytest

_PROBE = """
import json, sys
import jax, jax.numpy as jnp
from posttrain_jax.launch.cli import use_compile_cache
use_compile_cache(sys.argv[1])
events = []
jax.monitoring.register_event_listener(lambda event, **kw: events.append(event))
jax.monitoring.register_event_duration_secs_listener(lambda event, d, **kw: events.append(event))
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum() * 3.0)
float(f(jnp.arange(64.0).reshape(8, 8)))
hits = events.count("/jax/compilation_cache/cache_hits")
# the backend-compile event times a program's build, compiled or loaded from the cache
print(json.dumps({"hits": hits,
                  "compiles": events.count("/jax/core/compile/backend_compile_duration") - hits}))
"""


def _probe(path: str) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  out = subprocess.run([sys.executable, "-c", _PROBE, path], env=env, capture_output=True,
                       text=True, timeout=120, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("off", [False, True])
def test_a_second_process_loads_the_programs_the_first_compiled(tmp_path, off):
  path = "" if off else str(tmp_path / "xla")
  first, second = _probe(path), _probe(path)
  assert first["hits"] == 0 and first["compiles"] >= 1
  if off:
    assert second == first and not (tmp_path / "xla").exists()
  else:
    assert second == {"hits": first["compiles"], "compiles": 0}, (first, second)
