"""Online mode: the proxy serves the run's own policy from a thread of the training process.

With `rl.mode="online"` (run/sources/online.py), one command serves, records, trains on
the sessions as their grades arrive, and installs each step's weights into the serving engine
(TraceRollouts.update_weights). A swap never fails or stalls a call: the embedded sampler reads
its (params, version) pair once per call under a lock, so a call in flight finishes on the
weights it started with and reports their version, and the next call gets the new ones; an
engine that cuts calls on a swap (finish "abort") has them served again by the proxy. Every
recorded call carries the policy version that sampled each choice.

Per tenant (`rl.learner.lora.tenants`): `engines` maps each tenant to an engine view serving its
own adapter (byoh/tenant_source.py); the proxy routes every call to its caller's view.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Optional

from posttrain_jax.byoh.server import Proxy, ProxyConfig, detect_tool_format
from posttrain_jax.byoh.store import StoreConfig, TraceStore
from posttrain_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class OnlineConfig:
  """Serve while training, `rl.mode="online"` (see the module docstring)."""
  host: str = "127.0.0.1"
  port: int = 8000
  proxy: ProxyConfig = ProxyConfig()


class OnlineServer:
  """uvicorn + the proxy in a daemon thread; `close()` stops it."""

  def __init__(self, cfg: OnlineConfig, engine, tokenizer, stop_token_ids, store: StoreConfig,
               engines: Optional[dict] = None):
    import uvicorn
    from posttrain_jax.byoh.app import build_app
    self.store = TraceStore(store)
    self.proxy = Proxy(cfg.proxy, engine, tokenizer, self.store, tuple(stop_token_ids),
                       detect_tool_format(tokenizer), engines=engines)
    self.url = f"http://{cfg.host}:{cfg.port}/v1"
    # the stdlib event loop in the proxy's thread (no uvloop in the training process); uvicorn
    # leaves the signals alone outside the main thread, so the trainer keeps owning them
    self._server = uvicorn.Server(uvicorn.Config(build_app(self.proxy), host=cfg.host,
                                                 port=cfg.port, log_level="warning",
                                                 loop="asyncio"))
    self._thread = threading.Thread(target=self._server.run, name="online-proxy", daemon=True)
    self._thread.start()
    deadline = time.monotonic() + 60
    while not self._server.started:
      if not self._thread.is_alive() or time.monotonic() > deadline:
        self.close()
        raise UserError(f"rl.traces.online: the proxy could not listen on "
                        f"{cfg.host}:{cfg.port} (in use?)")
      time.sleep(0.02)

  def close(self) -> None:
    self._server.should_exit = True
    self._thread.join(timeout=30)
    self.proxy.close()
    self.store.close()
