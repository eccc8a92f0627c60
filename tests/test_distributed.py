"""Two local processes join one JAX job through sharding.initialize_distributed."""
import os
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

WORKER = r"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax
from posttrain_jax import sharding
sharding.initialize_distributed()
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=-1, tensor=1))
x = jax.make_array_from_callback((8,), NamedSharding(mesh, P("fsdp")),
                                 lambda idx: np.arange(8, dtype=np.float32)[idx])
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
print(f"proc={jax.process_index()} count={jax.process_count()} devices={jax.device_count()} "
      f"mesh={dict(mesh.shape)} sum={float(total)}")
"""


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_process_mesh(tmp_path):
  port = _free_port()
  procs = []
  for i in range(2):
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
           "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
           "JAX_PROCESS_ID": str(i), "JAX_PLATFORMS": "cpu"}
    procs.append(subprocess.Popen([sys.executable, "-c", WORKER], env=env, cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  outs = [p.communicate(timeout=120) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-2000:]
  lines = sorted(o.strip().splitlines()[-1] for o, _ in outs)
  assert lines == [
      "proc=0 count=2 devices=4 mesh={'data': 1, 'fsdp': 4, 'tensor': 1} sum=28.0",
      "proc=1 count=2 devices=4 mesh={'data': 1, 'fsdp': 4, 'tensor': 1} sum=28.0"]
