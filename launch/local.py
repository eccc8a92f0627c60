"""N processes of one JAX job on this host: `python launch/local.py --processes=2 -- CMD ...`.

    python launch/local.py --processes=2 --devices_per_process=4 -- \
        python launch/train.py --config=configs/default.py --workdir=runs/two

starts CMD once per process with the environment `posttrain_jax.sharding.initialize_distributed`
reads (JAX_COORDINATOR_ADDRESS on a free local port, JAX_NUM_PROCESSES, JAX_PROCESS_ID) and, on
CPU, `--xla_force_host_platform_device_count=<devices_per_process>`: a real multi-process job
(jax.distributed, Gloo CPU collectives) on one machine, the same program a multi-host cluster
runs, with the same flags and config files. It is what the multi-host tests and
benchmarks/multihost_equivalence.py use; on a GPU box give each process its GPU(s) with
`--gpus_per_process` (CUDA_VISIBLE_DEVICES) instead.

Each process's output lines are prefixed `[p<i>] ` (process 0's `RESULT` line is printed
unprefixed as well, so the last line of a run is still its RESULT). If one process fails, the
others are stopped (a collective it left would hang them) and the launcher exits with its
status; SIGTERM / SIGINT are passed on to every process (each checkpoints and exits 0,
launch/train.py). Exit status: 0 when every process exited 0.
"""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

_PROCESSES = flags.DEFINE_integer("processes", 2, "Processes of the job.")
_DEVICES = flags.DEFINE_integer("devices_per_process", 0,
                                "CPU devices per process (XLA's forced host device count); 0 "
                                "leaves XLA_FLAGS as they are.")
_GPUS = flags.DEFINE_integer("gpus_per_process", 0,
                             "GPUs per process: process i sees GPUs [i·k, (i+1)·k) "
                             "(CUDA_VISIBLE_DEVICES); 0 leaves it as it is.")
_PORT = flags.DEFINE_integer("port", 0, "Coordinator port on 127.0.0.1 (0: a free one).")
_GRACE = flags.DEFINE_float("grace_s", 30.0,
                            "Seconds the others get to exit after one process failed, before "
                            "they are killed.")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(i: int, n: int, port: int, devices: int = 0, gpus: int = 0,
                base: dict | None = None) -> dict:
  """The environment of process `i` of `n` (see the module docstring)."""
  env = dict(os.environ if base is None else base)
  env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(n),
             JAX_PROCESS_ID=str(i))
  if devices:
    flags_ = [f for f in env.get("XLA_FLAGS", "").split()
              if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags_ + [f"--xla_force_host_platform_device_count={devices}"])
  if gpus:
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(i * gpus, (i + 1) * gpus))
  return env


def _pump(i: int, proc: subprocess.Popen, lock: threading.Lock) -> None:
  for line in proc.stdout:
    with lock:
      sys.stdout.write(f"[p{i}] {line}")
      if i == 0 and line.startswith("RESULT "):
        sys.stdout.write(line)
      sys.stdout.flush()


def main(argv):
  cmd = argv[1:]
  if cmd[:1] == ["--"]:
    cmd = cmd[1:]
  if not cmd:
    sys.exit("error: give the command to run after --, e.g. "
             "`python launch/local.py --processes=2 -- python launch/train.py`")
  n = _PROCESSES.value
  if n < 1:
    sys.exit(f"error: --processes={n}: need at least 1")
  port = _PORT.value or _free_port()
  procs, lock = [], threading.Lock()
  for i in range(n):
    procs.append(subprocess.Popen(
        cmd, env=process_env(i, n, port, _DEVICES.value, _GPUS.value), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, bufsize=1))
  pumps = [threading.Thread(target=_pump, args=(i, p, lock), daemon=True)
           for i, p in enumerate(procs)]
  for t in pumps:
    t.start()

  def forward(signum, _frame):
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum)
  signal.signal(signal.SIGTERM, forward)
  signal.signal(signal.SIGINT, forward)

  failed = None
  while any(p.poll() is None for p in procs):
    for i, p in enumerate(procs):
      if failed is None and p.poll() not in (None, 0):
        failed = (i, p.returncode)
        print(f"launch/local.py: process {i} exited with status {p.returncode}; stopping the "
              "others", file=sys.stderr, flush=True)
        deadline = time.monotonic() + _GRACE.value
        for q in procs:
          if q.poll() is None:
            q.terminate()
        while any(q.poll() is None for q in procs) and time.monotonic() < deadline:
          time.sleep(0.2)
        for q in procs:
          if q.poll() is None:
            q.kill()
    time.sleep(0.2)
  for t in pumps:
    t.join(timeout=5)
  if failed is None:
    failed = next(((i, p.returncode) for i, p in enumerate(procs) if p.returncode), None)
  sys.exit(0 if failed is None else (failed[1] if failed[1] > 0 else 1))


if __name__ == "__main__":
  app.run(main)
