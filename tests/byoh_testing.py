"""A real proxy server for the BYOH tests: uvicorn on a free port in a background thread."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from posttrain_jax.byoh.app import build_app
from posttrain_jax.byoh.server import Proxy, ProxyConfig
from posttrain_jax.byoh.store import StoreConfig, TraceStore
from tests import envs_testing as et


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def running(engine, db_path, cfg: ProxyConfig = ProxyConfig(), chat_format: str = "hermes"):
  """Yields (base_url, proxy) for a proxy on `engine` recording into `db_path`."""
  tok = et.tokenizer(chat_format)
  store = TraceStore(StoreConfig(path=str(db_path), synchronous="NORMAL"))
  proxy = Proxy(cfg, engine, tok, store, et.stop_ids(tok, chat_format), "hermes")
  port = free_port()
  # the stdlib event loop: uvloop's C-level state stays out of the pytest process, whose main
  # thread runs asyncio (and SIGINT) tests of its own
  server = uvicorn.Server(uvicorn.Config(build_app(proxy), host="127.0.0.1", port=port,
                                         log_level="warning", loop="asyncio"))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  deadline = time.monotonic() + 30
  while not server.started:
    if time.monotonic() > deadline or not thread.is_alive():
      raise RuntimeError("the proxy did not start")
    time.sleep(0.02)
  try:
    yield f"http://127.0.0.1:{port}", proxy
  finally:
    server.should_exit = True
    thread.join(timeout=10)
    proxy.close()
    store.close()
