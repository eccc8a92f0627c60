"""A rollout fleet: several OpenAI-compatible servers (vLLM) behind one Engine.

    rl.engine = "fleet"
    rl.engine_config.urls = ("http://node1:8000", "http://node2:8000", ...)   # a static list
    rl.engine_config.server = OpenAIEngineConfig(weights_dir=<shared dir>, ...)  # per server

Each server is driven by its own `OpenAIEngine` client (openai_engine.py). The fleet adds:

Routing: each prompt (one request for its `n` completions) goes to the server in service with
the fewest completions in flight from this fleet (least loaded; ties by round robin), so a slow
or busy server gets less work and a batch spreads over every server.

Failure: a request that fails on the server's side (`ServerUnreachable`: refused, reset, timed
out, 5xx after the client's retries; or any other EngineError but a 4xx, which blames the
request and is raised) takes its server out of service, and that prompt's completions come
back with finish_reason "error" and no tokens: the rollout makes them
`infra_error` (never graded, never a reward of 0) and, the whole group having failed, requeues
the task (actors/rollout.py). Requests already on other servers are untouched; later requests
go to the servers in service. No server in service: `generate` raises ServerUnreachable, which
the rollout source retries with backoff and then requeues.

Health: a thread probes every server each `health_interval_s` (GET /v1/models, then the
version its workers hold): one that stops answering, or that answers holding other weights
than the fleet's (restarted between two probes: start weights), is taken out before a request
is lost on it or tagged wrongly; one that answers again (restarted by its supervisor, Ray or a
person) is readmitted only once it holds the fleet's current weights (reloaded from the
current checkpoint and its version read back from the server). A round does not wait for a
weight update in progress: readmission waits for the next round.

Weights: `update_weights` writes one checkpoint to `<server.weights_dir>/v<version>` (storage
every server reads), then each server in service loads it concurrently (pause, reload, reset
prefix cache, resume: OpenAIEngine.load_checkpoint) and is asked which version it now holds; a
server that fails to load or reports another version is taken out (and readmitted later by the
health check, with the current weights). If no server took it (all out at that moment), the
update waits up to `server.server_wait_s` for one to be readmitted with it, then fails. The
previous checkpoint is removed once the new one is in; the current one is kept for servers
that come back. One learner process drives a fleet (several would each push to every server).

Placement: a static URL list (`urls`: servers someone else runs), or Ray (`ray.servers` > 0:
fleet_ray.py places one server actor per slot, restarts dead ones, and the health round follows
a slot to its new URL through the `discover` hook, readmitting it with the current weights).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import pathlib
import shutil
import threading
import time
import urllib.request
from typing import Any, Callable, Optional, Sequence

from posttrain_jax.engines.base import Completion, EngineError, SamplingParams
from posttrain_jax.engines.fleet_ray import RayFleetConfig
from posttrain_jax.engines.openai_engine import (
    OpenAIEngine, OpenAIEngineConfig, RequestRejected, ServerUnreachable, write_checkpoint)
from posttrain_jax.engines.registry import DecoderWeights, EngineContext, register_engine


@dataclasses.dataclass(frozen=True)
class FleetConfig:
  """The servers and how the fleet treats them."""
  urls: tuple[str, ...] = ()          # server roots (the /v1 prefix is added), one per server
  server: OpenAIEngineConfig = OpenAIEngineConfig()  # client settings for each (base_url unused)
  health_interval_s: float = 5.0      # probe every server this often (0 = no health thread)
  max_concurrency: int = 64           # parallel requests over the whole fleet
  ray: RayFleetConfig = RayFleetConfig()  # servers placed by Ray (ray.servers > 0), not urls


@dataclasses.dataclass
class _Member:
  url: str
  client: Optional[OpenAIEngine]      # None until the server first answered
  up: bool = False
  load: int = 0                       # completions in flight from this fleet
  requests: int = 0
  taken_out: int = 0
  readmitted: int = 0
  why: str = ""                       # the last reason it was taken out


class FleetEngine:
  """Engine over several OpenAI-compatible servers (module docstring)."""

  def __init__(self, cfg: FleetConfig, version: int = 0,
               discover: Optional[Callable[[], Sequence[Optional[str]]]] = None,
               on_close: Optional[Callable[[], None]] = None):
    """`discover()`: the servers' current URLs by slot (None = not known yet), asked at start
    (when `cfg.urls` is empty) and each health round; `on_close()` runs after `close()`."""
    urls = tuple(cfg.urls) or (tuple(discover()) if discover is not None else ())
    if not urls:
      raise EngineError("FleetConfig.urls is empty: give the fleet at least one server URL")
    if None in urls or len(set(urls)) != len(urls):
      raise EngineError(f"FleetConfig.urls lists a server twice: {list(urls)}")
    self.cfg = cfg
    self._discover, self._on_close = discover, on_close
    self._version = version
    self._current_dir: Optional[pathlib.Path] = None
    self._lock = threading.Lock()           # members' state
    self._sync = threading.Lock()           # weight updates and readmissions, one at a time
    self._rr = itertools.count()
    self._members = [_Member(u, None) for u in urls]
    self._pool = concurrent.futures.ThreadPoolExecutor(cfg.max_concurrency,
                                                       thread_name_prefix="fleet")
    # weight loads on their own threads: never queued behind the prompts waiting in _pool
    self._loader = concurrent.futures.ThreadPoolExecutor(len(urls) + 4,
                                                         thread_name_prefix="fleet-load")
    self.last_weight_sync: Optional[dict[str, float]] = None
    self.last_discover_error: Optional[str] = None
    errors = []
    for m in self._members:
      try:
        m.client = self._client(m.url)
        m.up = True
      except ServerUnreachable as e:
        m.why = str(e)
        errors.append(m.why)
    if not any(m.up for m in self._members):
      raise ServerUnreachable("no server of the fleet answers:\n  " + "\n  ".join(errors))
    models = {m.client.model for m in self._members if m.client is not None}
    if len(models) != 1:
      raise EngineError(f"the fleet's servers serve different models: {sorted(models)}")
    self.model = models.pop()
    self._closing = threading.Event()
    self._health = None
    if cfg.health_interval_s > 0:
      self._health = threading.Thread(target=self._watch, daemon=True, name="fleet-health")
      self._health.start()

  # -- protocol ------------------------------------------------------------------------------

  @property
  def version(self) -> int:
    return self._version

  def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, n: int = 1,
               seed: Optional[int] = None) -> list[list[Completion]]:
    """`n` completions per prompt, each prompt on the least-loaded server in service; a
    prompt whose server failed comes back as n "error" completions (module docstring)."""
    for i, p in enumerate(prompts):
      if len(p) == 0:
        raise EngineError(f"prompt {i} is empty")
    futures = [self._pool.submit(self._one, [int(t) for t in p], sampling, n,
                                 None if seed is None else seed + i * n)
               for i, p in enumerate(prompts)]
    return [f.result() for f in futures]

  def update_weights(self, weights: Any, version: int) -> None:
    """One checkpoint on shared storage, loaded by every server in service (module docstring)."""
    if version < self._version:
      raise EngineError(f"version skew: update_weights(version={version}) but the fleet "
                        f"already serves version {self._version}")
    wdir = self.cfg.server.weights_dir
    if wdir is None:
      raise EngineError("the fleet's update_weights needs FleetConfig.server.weights_dir: a "
                        "directory every server can read")
    with self._sync:
      t0 = time.perf_counter()
      path = write_checkpoint(weights, pathlib.Path(wdir) / f"v{version:08d}",
                              self.cfg.server.weights_dtype)
      t1 = time.perf_counter()
      with self._lock:
        targets = [m for m in self._members if m.up]
      results = list(self._loader.map(lambda m: self._load(m, path, version), targets))
      # current even if no server took it: a server readmitted from now on loads this one
      old, self._current_dir, self._version = self._current_dir, path, version
      if old is not None and old != path:
        shutil.rmtree(old, ignore_errors=True)
    if not any(results):   # every server out: wait for the health check to readmit one
      deadline = time.monotonic() + self.cfg.server.server_wait_s
      while not any(m.up for m in self._members):
        if time.monotonic() > deadline:
          raise ServerUnreachable(
              f"weight update to version {version}: no server of the fleet took it within "
              f"server_wait_s={self.cfg.server.server_wait_s:g} s ({self._describe()})")
        if self._health is None:
          self.check_health()
        time.sleep(min(1.0, self.cfg.health_interval_s or 1.0))
    self.last_weight_sync = {"write_s": t1 - t0, "load_s": time.perf_counter() - t1,
                             "seconds": time.perf_counter() - t0,
                             "servers": float(sum(results))}

  def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
    """Teacher-forced log-probs (OpenAIEngine.score) on the least-loaded server in service."""
    m, client = self._acquire(len(sequences))
    try:
      return client.score(sequences)
    except ServerUnreachable as e:
      self._take_out(m, e)
      raise
    finally:
      self._release(m, len(sequences))

  def metrics(self) -> dict[str, float]:
    """fleet/servers_up and, per server i, its requests and times taken out / readmitted."""
    with self._lock:
      out = {"fleet/servers_up": float(sum(m.up for m in self._members)),
             "fleet/servers": float(len(self._members))}
      for i, m in enumerate(self._members):
        out.update({f"fleet/{i}/up": float(m.up), f"fleet/{i}/requests": float(m.requests),
                    f"fleet/{i}/taken_out": float(m.taken_out),
                    f"fleet/{i}/readmitted": float(m.readmitted)})
    return out

  def servers(self) -> list[dict]:
    """Each server's URL, state and counts (for logs and tests)."""
    with self._lock:
      return [{"url": m.url, "up": m.up, "load": m.load, "requests": m.requests,
               "taken_out": m.taken_out, "readmitted": m.readmitted, "why": m.why}
              for m in self._members]

  def check_health(self) -> None:
    """One round of the health check (the thread runs it every `health_interval_s`)."""
    if self._discover is not None:
      try:
        self._follow(self._discover())
      except Exception as e:  # noqa: BLE001 -- the probes below still run
        self.last_discover_error = f"{type(e).__name__}: {e}"
    for m in list(self._members):
      if self._closing.is_set():
        return
      if m.up:
        why = self._unhealthy(m)
        if why:
          self._take_out(m, EngineError(why))
      elif self._answers(m):
        self._readmit(m)

  def close(self) -> None:
    self._closing.set()
    if self._health is not None:
      self._health.join(10)
    self._pool.shutdown(wait=False, cancel_futures=True)
    self._loader.shutdown(wait=False, cancel_futures=True)
    for m in self._members:
      if m.client is not None:
        m.client.close()
    if self._on_close is not None:
      self._on_close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # -- helpers -------------------------------------------------------------------------------

  def _client(self, url: str) -> OpenAIEngine:
    return OpenAIEngine(dataclasses.replace(self.cfg.server, base_url=url), version=self._version)

  def _one(self, prompt: list[int], sampling: SamplingParams, n: int,
           seed: Optional[int]) -> list[Completion]:
    m, client = self._acquire(n)
    try:
      return client.generate([prompt], sampling, n=n, seed=seed)[0]
    except RequestRejected:
      raise                  # this request's fault (4xx), not the server's
    except EngineError as e:
      self._take_out(m, e)
      return [Completion(token_ids=[], logprobs=[], finish_reason="error",
                         version=client.version) for _ in range(n)]
    finally:
      self._release(m, n)

  def _acquire(self, n: int) -> tuple[_Member, OpenAIEngine]:
    """The least-loaded member in service and its client (read together: a slot that moves
    gets a new client), its load raised by n."""
    with self._lock:
      up = [m for m in self._members if m.up]
      if not up:
        raise ServerUnreachable(f"no server of the fleet is in service ({self._describe()})")
      k = next(self._rr)
      m = min(up, key=lambda m: (m.load, (self._members.index(m) - k) % len(self._members)))
      m.load += n
      m.requests += 1
      return m, m.client

  def _release(self, m: _Member, n: int) -> None:
    with self._lock:
      m.load -= n

  def _take_out(self, m: _Member, why: Exception) -> None:
    with self._lock:
      if m.up:
        m.up, m.why = False, str(why)
        m.taken_out += 1

  def _load(self, m: _Member, path: pathlib.Path, version: int) -> bool:
    """Has `m` load `path` as `version` and checks what it reports; False = taken out."""
    client = m.client
    try:
      client.load_checkpoint(path, version, server_wait_s=0)
      served = client.served_version()
      if served not in ("unknown", version):
        raise EngineError(f"{m.url} reports version {served} after loading version {version}")
      return True
    except EngineError as e:
      self._take_out(m, e)
      return False

  def _readmit(self, m: _Member) -> None:
    """A server that answers again: current weights first, then back in service. Skipped
    while a weight update holds the fleet (the next round tries again)."""
    if not self._sync.acquire(blocking=False):
      return
    try:
      try:
        if m.client is None:
          client = self._client(m.url)
          if client.model != self.model:
            client.close()
            raise EngineError(f"{m.url} serves {client.model!r}, the fleet {self.model!r}")
          m.client = client
        if self._current_dir is not None:
          if not self._load(m, self._current_dir, self._version):
            return
        elif m.client.served_version() not in (None, "unknown"):
          raise EngineError(f"{m.url} holds trained weights, the fleet its start weights")
      except EngineError as e:
        with self._lock:
          m.why = str(e)
        return
      with self._lock:
        m.up, m.why = True, ""
        m.readmitted += 1
    finally:
      self._sync.release()

  def _unhealthy(self, m: _Member) -> str:
    """Why a member in service must be taken out ("" = it is fine): it does not answer, or
    its workers hold other weights than its client tags completions with (a restart between
    two probes). The version is not read during a weight update (it changes under it)."""
    if not self._answers(m):
      return f"{m.url} stopped answering the health check"
    if not self._sync.acquire(blocking=False):
      return ""
    try:
      client = m.client
      served = client.served_version()
      expected = client.version if self._current_dir is not None else None
      if served not in ("unknown", expected):
        return (f"{m.url} holds weights version {served}, its completions would be tagged "
                f"{expected} (restarted between two health checks?)")
      return ""
    except EngineError as e:
      return f"{m.url}: the health check could not read its weights' version ({e})"
    finally:
      self._sync.release()

  def _answers(self, m: _Member) -> bool:
    """GET /v1/models answers within the connect timeout (no retries)."""
    key = self.cfg.server.api_key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(f"{m.url.rstrip('/')}/v1/models", headers=headers)
    try:
      with urllib.request.urlopen(req, timeout=self.cfg.server.connect_timeout_s) as r:
        return r.status == 200
    except (OSError, ValueError):
      return False

  def _follow(self, urls: Sequence[Optional[str]]) -> None:
    """Slot i's server now answers at urls[i] (moved or new): out until readmitted there."""
    for i, url in enumerate(urls):
      if url is None:
        continue
      with self._lock:
        if i >= len(self._members):
          self._members.append(_Member(url, None, why="new"))
          continue
        m = self._members[i]
        if m.url == url:
          continue
        if m.up:
          m.taken_out += 1
        old, m.url, m.client, m.up, m.why = m.client, url, None, False, f"moved to {url}"
      if old is not None:
        old.close()

  def _watch(self) -> None:
    while not self._closing.wait(self.cfg.health_interval_s):
      try:
        self.check_health()
      except Exception:  # noqa: BLE001 -- the watcher must outlive one bad round
        pass

  def _describe(self) -> str:
    return "; ".join(f"{m.url}: {'up' if m.up else 'out: ' + (m.why or 'down')}"
                     for m in self._members)


def _check(cfg: FleetConfig, model_config, max_tokens: int, *,
           field: str = "config.rl.engine_config", serving: bool = False) -> None:
  """Before the run: servers listed (or placed by Ray), and a weights directory they all read
  (unless the fleet only serves, behind the proxy)."""
  del model_config, max_tokens
  from posttrain_jax.config_io import ConfigTypeError
  if not cfg.urls and cfg.ray.servers < 1:
    raise ConfigTypeError(f"{field}.urls: the fleet engine needs the servers' "
                          f"URLs, or {field}.ray.servers > 0 to have Ray place them")
  if cfg.urls and cfg.ray.servers > 0:
    raise ConfigTypeError(f"{field}: set urls (servers you run) or ray.servers "
                          "(servers Ray places), not both")
  if not serving and not cfg.server.weights_dir:
    raise ConfigTypeError(f"{field}.server.weights_dir: rl.engine='fleet' needs "
                          "a directory this process and every server read, for weight sync")


@register_engine("fleet", FleetConfig, check=_check, copies_weights=True, processes="one")
def _build(cfg: FleetConfig, ctx: EngineContext):
  """A client of servers the user already runs (each started from the RL start weights with
  our worker extension; see openai_engine.py), or of servers Ray places (fleet_ray.py)."""
  if cfg.ray.servers > 0:
    from posttrain_jax.engines.fleet_ray import RayFleet
    placed = RayFleet(cfg.ray, ctx.model_dir, max_model_len=ctx.max_prompt_len + ctx.max_tokens)
    try:
      engine = FleetEngine(cfg, discover=placed.urls, on_close=placed.close)
    except BaseException:
      placed.close()
      raise
  else:
    engine = FleetEngine(cfg)
  return DecoderWeights(engine, ctx.graphdef)


__all__ = ["FleetConfig", "FleetEngine"]
