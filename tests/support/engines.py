"""Shared test helpers (engines), moved out of the test modules that used to import each other."""
import os
import pathlib
import signal
import socket
import threading
import time


def server_alive(pid: int) -> bool:
  """Running (a zombie waiting for an init that does not reap counts as dead)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


class KillingProxy:
  """A TCP forwarder between the engine and the server: once `arm()`ed, the first
  POST /v1/completions that passes through is forwarded and then the server's process group is
  killed (SIGKILL), so the kill lands with a rollout's request in flight at the server, not
  between two requests (where update_weights would just wait for the restart). The answer to
  that request is never passed back, so a server that answers within the forwarder's 50 ms (a
  few tokens) still loses it. With `kill_first` the server is killed before the request is
  passed on."""

  def __init__(self, server, kill_first: bool = False):
    self.server, self.armed, self.killed_pid = server, threading.Event(), None
    self.kill_first = kill_first
    self._arm_when = None
    self._lsock = socket.create_server(("127.0.0.1", 0))
    self.url = f"http://127.0.0.1:{self._lsock.getsockname()[1]}"
    threading.Thread(target=self._accept, daemon=True).start()

  def arm(self):
    self.armed.set()

  def arm_after_step(self, workdir, step: int) -> None:
    """Arms once metrics.jsonl in `workdir` holds step `step`'s row. Checked when a request
    arrives, not by a polling thread: the trainer flushes a step's row before the next step's
    rollouts, so the kill lands in step `step + 1` however late a poller would wake (in one CI
    run a 50 ms poller armed after step 3's 0.3 s of rollouts had already gone through)."""
    from posttrain_jax.metrics import read_metrics
    path = pathlib.Path(workdir) / "metrics.jsonl"
    self._arm_when = lambda: path.exists() and any(
        r.get("policy_version") == step for r in read_metrics(path))

  def _accept(self):
    while True:
      try:
        client, _ = self._lsock.accept()
      except OSError:
        return
      try:
        upstream = socket.create_connection(("127.0.0.1", self.server.port), timeout=5)
      except OSError:
        client.close()  # the server is down: the engine sees a refused / reset connection
        continue
      upstream.settimeout(None)
      doomed = threading.Event()  # this connection carried the killing request
      threading.Thread(target=self._pipe, args=(client, upstream, True, doomed), daemon=True).start()
      threading.Thread(target=self._pipe, args=(upstream, client, False, doomed), daemon=True).start()

  def _should_kill(self, data: bytes) -> bool:
    if self.killed_pid is not None or b"POST /v1/completions" not in data:
      return False
    if not self.armed.is_set() and self._arm_when is not None and self._arm_when():
      self.armed.set()
    return self.armed.is_set()

  def _pipe(self, src, dst, to_server, doomed):
    try:
      while data := src.recv(65536):
        if not to_server and doomed.is_set():
          break  # the answer to the killing request never reaches the engine, however fast
        kill = to_server and self._should_kill(data)
        if kill:
          self.killed_pid = self.server.proc.pid
          doomed.set()
        if kill and self.kill_first:
          os.killpg(self.killed_pid, signal.SIGKILL)
          time.sleep(0.2)   # gone before the request reaches it
        dst.sendall(data)
        if kill and not self.kill_first:
          time.sleep(0.05)  # the request has reached the server
          os.killpg(self.killed_pid, signal.SIGKILL)
    except OSError:
      pass
    finally:
      for s in (src, dst):
        try:
          s.shutdown(socket.SHUT_RDWR)
        except OSError:
          pass
        s.close()

  def close(self):
    self._lsock.close()

