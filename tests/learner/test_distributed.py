"""Two local processes join one JAX job through sharding.initialize_distributed."""
from tests.support.distributed import run_processes

WORKER = r"""
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


def test_two_process_mesh(tmp_path):
  outs = run_processes(WORKER, tmp_path, processes=2, devices=2)
  lines = [o.strip().splitlines()[-1] for o in outs]
  assert lines == [
      "proc=0 count=2 devices=4 mesh={'data': 1, 'fsdp': 4, 'tensor': 1} sum=28.0",
      "proc=1 count=2 devices=4 mesh={'data': 1, 'fsdp': 4, 'tensor': 1} sum=28.0"]
