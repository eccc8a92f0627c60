"""Placement and restart of a vLLM fleet by Ray: one actor per server, the fleet follows them.

    rl.engine = "fleet"
    rl.engine_config.ray.servers = 4          # 0 = no Ray: the static rl.engine_config.urls
    rl.engine_config.ray.num_gpus = 1         # per server (0 on a CPU)
    rl.engine_config.ray.address = "auto"     # a running cluster (`ray start --head` ...);
                                              # None = a local Ray started by this process

Each server is a Ray actor (`_ServerActor`) that starts a LocalVLLMServer (vllm_server.py: our
worker extension, processed log-probs, dev-mode endpoints) on the node Ray places it on, from
the run's RL start weights, and reports `http://<node ip>:<port>`. Ray places the actors
(SPREAD: one per node while nodes last; `num_gpus` reserves the accelerator) and restarts an
actor whose process dies (`max_restarts`; the server it started gets SIGTERM then, by
PR_SET_PDEATHSIG, and stops its engine processes), possibly on another node and port. A server that crashes while its actor lives is restarted by
the actor's own supervisor, on the same port (`server.max_restarts`).

`urls()` is the fleet's `discover` hook (fleet.py): each health round it asks every actor for its
URL without blocking on one that is restarting (that slot keeps its old URL and stays out of
service); a slot whose URL changed is taken out and readmitted once its new server holds the
current weights. `close()` stops each server's whole process group, then ends the actors.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Optional

from posttrain_jax.engines.base import EngineError


@dataclasses.dataclass(frozen=True)
class RayFleetConfig:
  """How many servers Ray places, where, and how often it restarts them."""
  servers: int = 0                    # vLLM servers to place (0 = no Ray: FleetConfig.urls)
  address: Optional[str] = None       # Ray cluster ("auto", "ray://host:10001"); None = local
  num_gpus: float = 0.0               # reserved per server actor (1 on a GPU cluster)
  num_cpus: float = 1.0               # reserved per server actor
  max_restarts: int = 3               # Ray restarts a dead server actor this many times
  server_restarts: int = 1            # a crashed server restarted by its live actor (same port)
  dtype: str = "auto"                 # the servers' --dtype
  max_model_len: Optional[int] = None  # None = longest prompt + completion of the run
  enforce_eager: bool = False         # no torch.compile / CUDA graphs (faster start)
  startup_timeout_s: float = 600.0    # one server must answer within this
  extra_args: tuple[str, ...] = ()    # further vLLM api_server flags


class _ServerActor:
  """A Ray actor owning one LocalVLLMServer on its node. A server that cannot start, or that is
  down for good (its own restarts used up), ends the actor's process: Ray restarts a crashed
  actor (`max_restarts`) but not one whose constructor raised or that lives on serverless."""

  def __init__(self, server_cfg):
    import os
    import threading
    import ray
    from posttrain_jax.engines.vllm_server import LocalVLLMServer
    try:
      self.server = LocalVLLMServer(server_cfg).start()
    except Exception as e:  # noqa: BLE001 -- reported in the actor's log, then a crash
      print(f"vLLM server failed to start on this node: {e}", flush=True)
      os._exit(1)
    self.host = ray.util.get_node_ip_address()
    self._stopping = False
    threading.Thread(target=self._watch, daemon=True, name="server-watch").start()

  def _watch(self) -> None:
    import os
    import time
    while not self._stopping:
      sup, proc = self.server._supervisor, self.server.proc  # noqa: SLF001
      restarting = sup is not None and sup.is_alive()
      if not restarting and (proc is None or proc.poll() is not None) and not self._stopping:
        print("vLLM server is down for good in this actor: exiting for Ray to restart it",
              flush=True)
        os._exit(1)
      time.sleep(1.0)

  def url(self) -> str:
    return f"http://{self.host}:{self.server.port}"

  def pid(self) -> int:
    """The server's process (group) id: what a test kills."""
    return self.server.proc.pid

  def stop(self) -> None:
    """SIGTERM to the server's process group (its engine core and workers too), SIGKILL after
    30 s. Ray's own kill of an actor would SIGKILL the server alone (Ray kills a worker's direct
    children on exit), orphaning vLLM's engine core."""
    self._stopping = True
    self.server.close()

  def actor_pid(self) -> int:
    import os
    return os.getpid()


class RayFleet:
  """`cfg.servers` vLLM servers as Ray actors (module docstring)."""

  def __init__(self, cfg: RayFleetConfig, model_dir: pathlib.Path,
               max_model_len: Optional[int] = None):
    try:
      import ray
    except ImportError:
      raise EngineError("rl.engine_config.ray.servers > 0 needs Ray: pip install "
                        "'posttrain_jax[ray]' (or set rl.engine_config.urls)") from None
    from posttrain_jax.engines.vllm_server import LocalServerConfig
    if cfg.servers < 1:
      raise EngineError(f"RayFleetConfig.servers={cfg.servers}: place at least one server")
    self._ray = ray
    self._started_ray = False
    if not ray.is_initialized():
      ray.init(address=cfg.address, include_dashboard=False, log_to_driver=False)
      self._started_ray = True
    server_cfg = LocalServerConfig(
        model=str(model_dir), host="0.0.0.0",   # the learner may be on another node
        dtype=cfg.dtype, max_model_len=cfg.max_model_len or max_model_len,
        enforce_eager=cfg.enforce_eager, startup_timeout_s=cfg.startup_timeout_s,
        extra_args=tuple(cfg.extra_args), max_restarts=cfg.server_restarts)
    actor = ray.remote(num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus,
                       max_restarts=cfg.max_restarts)(_ServerActor)
    self.actors = [actor.options(scheduling_strategy="SPREAD").remote(server_cfg)
                   for _ in range(cfg.servers)]
    self._pending: dict[int, object] = {}
    self._last: list[Optional[str]] = [None] * cfg.servers
    try:   # every server up before the run starts (a start-up failure is reported here)
      self._last = ray.get([a.url.remote() for a in self.actors],
                           timeout=cfg.startup_timeout_s + 60)
    except Exception as e:  # noqa: BLE001 -- a failed start, as one error naming the cause
      self.close()
      raise EngineError(f"Ray could not start the fleet's {cfg.servers} vLLM server(s): "
                        f"{type(e).__name__}: {e}") from None

  def urls(self, wait_s: float = 1.0) -> list[Optional[str]]:
    """Each actor's current URL; a slot whose actor is restarting keeps its last URL."""
    ray = self._ray
    for i, a in enumerate(self.actors):
      if i not in self._pending:
        self._pending[i] = a.url.remote()
    refs = list(self._pending.values())
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    ready = set(ready)
    for i, ref in list(self._pending.items()):
      if ref in ready:
        del self._pending[i]
        try:
          self._last[i] = ray.get(ref)
        except Exception:  # noqa: BLE001 -- the actor died; asked again next round
          pass
    return list(self._last)

  def close(self) -> None:
    """Stops every server (whole process groups), then ends the actors."""
    ray = self._ray
    stops = [a.stop.remote() for a in self.actors]
    if stops:
      ray.wait(stops, num_returns=len(stops), timeout=60)
    for a in self.actors:
      try:
        ray.kill(a, no_restart=True)
      except Exception:  # noqa: BLE001 -- already gone
        pass
    self.actors = []
    if self._started_ray:
      self._ray.shutdown()
      self._started_ray = False


__all__ = ["RayFleet", "RayFleetConfig"]
