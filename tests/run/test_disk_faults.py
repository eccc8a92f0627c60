"""Disk trouble, made for real: every write the system does (checkpoint, HF export, trace
store, weight-sync buffer, metrics) into a FULL or READ-ONLY directory fails with a clear error
naming the path and the cause, and what was there before stays intact and readable.

Faults are real file systems, not mocks: a small tmpfs mounted under tmp_path (full once a
filler file takes the rest of it; mounting needs root / CAP_SYS_ADMIN, as in CI) and the same
tmpfs remounted read-only (`mount -o remount,ro`: root ignores chmod, so a mode is no fault).
Without mount permission the tests skip, saying so.
"""
import contextlib
import errno
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain_jax.byoh.store import Choice, StoreConfig, StoreError, StoreWriteError, TraceStore
from posttrain_jax.checkpoint import CheckpointConfig, Checkpointer, CheckpointWriteError
from posttrain_jax.engines import vllm_worker
from posttrain_jax.errors import DiskWriteError, UserError
from posttrain_jax.metrics import MetricsWriter, read_metrics
from posttrain_jax.models import hf_io
from posttrain_jax.types import TrainState
from tests.support.learner import small_model

ROOT = pathlib.Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ real faults

@pytest.fixture
def small_fs(tmp_path):
  """small_fs(size) -> a fresh tmpfs of `size` ("1m") under tmp_path, unmounted afterwards."""
  mounts = []

  def make(size: str) -> pathlib.Path:
    if shutil.which("mount") is None:
      pytest.skip("no `mount` command: these tests make real ENOSPC / EROFS faults on a tmpfs")
    d = tmp_path / f"fs{len(mounts)}"
    d.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                         capture_output=True, text=True)
    if out.returncode:
      pytest.skip("cannot mount a tmpfs (needs root / CAP_SYS_ADMIN) to make a real full or "
                  f"read-only file system: {out.stderr.strip()}")
    mounts.append(d)
    return d

  yield make
  for d in mounts:
    subprocess.run(["umount", "-l", str(d)], capture_output=True)


@contextlib.contextmanager
def full(fs: pathlib.Path, leave: int = 0):
  """`fs` with all but `leave` bytes taken by a filler file (removed at the end)."""
  filler = fs / "filler"
  fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
  try:
    while True:
      st = os.statvfs(fs)
      room = st.f_bavail * st.f_frsize - leave
      if room <= 0:
        break
      os.write(fd, b"\0" * min(room, 1 << 20))
  except OSError as e:
    assert e.errno == errno.ENOSPC
  finally:
    os.close(fd)
  try:
    yield
  finally:
    filler.unlink()


@contextlib.contextmanager
def read_only(fs: pathlib.Path):
  """`fs` remounted read-only (back to read-write at the end)."""
  subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True, capture_output=True)
  try:
    with pytest.raises(OSError) as e:  # the fault is real
      (fs / "probe").write_text("x")
    assert e.value.errno == errno.EROFS
    yield
  finally:
    subprocess.run(["mount", "-o", "remount,rw", str(fs)], check=True, capture_output=True)


def _fault(kind: str, fs: pathlib.Path):
  return full(fs) if kind == "full" else read_only(fs)


ERRNO = {"full": errno.ENOSPC, "read_only": errno.EROFS}
CAUSE = {"full": "no space left on device (ENOSPC)", "read_only": "read-only file system (EROFS)"}


def _files(d: pathlib.Path) -> dict[str, bytes]:
  return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ checkpoints

def _state(value: float, n: int = 1024) -> TrainState:
  return TrainState(params={"w": jnp.full((n,), value, jnp.float32)},
                    opt_state={"mu": jnp.full((n,), -value, jnp.float32)},
                    step=jnp.int32(int(value)), rng=jax.random.key(int(value)))


def _assert_restores(directory: pathlib.Path, step: int, value: float) -> None:
  """A fresh Checkpointer (what the next resume opens) finds `step` latest, with its arrays
  and side-car."""
  ck = Checkpointer(directory)
  assert ck.latest_step() == step
  state, extra = ck.restore(_state(0.0))
  assert extra == {"step": step, "note": f"after step {step}"}
  np.testing.assert_array_equal(np.asarray(state.params["w"]), np.full(1024, value))
  np.testing.assert_array_equal(np.asarray(state.opt_state["mu"]), np.full(1024, -value))
  assert int(state.step) == int(value)
  ck.close()


def _big_state(step: int, n: int) -> TrainState:
  """n random float32 (which no compression shrinks) + the rng key."""
  return TrainState(params={"w": jax.random.normal(jax.random.key(step), (n,))}, opt_state={},
                    step=jnp.int32(step), rng=jax.random.key(step))


def _save(ck: Checkpointer, step: int, value: float, n: int = 1024) -> None:
  state = _state(value) if n == 1024 else _big_state(step, n)
  ck.save(step, state, {"step": step, "note": f"after step {step}"})
  ck.wait()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", ["full", "read_only"])
def test_checkpoint_save_fault_keeps_the_previous_checkpoint(small_fs, kind, async_save):
  fs = small_fs("2m")
  directory = fs / "checkpoints"
  ck = Checkpointer(directory, CheckpointConfig(every_steps=1, max_to_keep=1,
                                                async_save=async_save))
  _save(ck, 1, 1.0)
  with _fault(kind, fs):
    with pytest.raises(CheckpointWriteError) as e:
      _save(ck, 2, 2.0)
    assert isinstance(e.value, UserError) and e.value.errno == ERRNO[kind]
    msg = str(e.value)
    assert f"checkpoint {directory / '2'} was not written: {CAUSE[kind]}" in msg, msg
    assert "checkpoint 1 is still the latest and restores" in msg, msg
    assert "rerun the same command to resume" in msg
    # max_to_keep=1 did not delete step 1 for a step 2 that never came; no temp dir is left
    assert sorted(p.name for p in directory.iterdir()) == ["1"]
  _assert_restores(directory, 1, 1.0)
  _save(ck, 3, 3.0)  # the same Checkpointer works again once the disk does
  ck.close()
  _assert_restores(directory, 3, 3.0)


def test_async_save_fault_is_reported_at_the_next_save_naming_its_step(small_fs):
  """Step 2's async write runs out of disk in the background; the next save (step 3) reports
  it as step 2's, the step's size and the free bytes in the message, and the next try works."""
  fs = small_fs("4m")
  directory = fs / "ck"
  ck = Checkpointer(directory, CheckpointConfig(max_to_keep=1, async_save=True))
  _save(ck, 1, 1.0)
  with full(fs, leave=96 << 10):
    ck.save(2, _big_state(2, 256 << 10), {"step": 2, "note": "after step 2"})  # returns at once
    with pytest.raises(CheckpointWriteError) as e:
      ck.save(3, _state(3.0), {"step": 3, "note": "after step 3"})
    msg = str(e.value)
    assert msg.startswith(f"checkpoint {directory / '2'} was not written: no space left on device "
                          "(ENOSPC), the step has 1.05 MB (1048588 bytes) of arrays, "), msg
    assert " free there; checkpoint 1 is still the latest and restores" in msg, msg
    assert sorted(p.name for p in directory.iterdir()) == ["1"]
  _save(ck, 3, 3.0)
  ck.close()
  _assert_restores(directory, 3, 3.0)


_ASYNC_RO_SAVE = """
import subprocess, sys, jax, jax.numpy as jnp
from posttrain_jax.checkpoint import CheckpointConfig, Checkpointer, CheckpointWriteError
from posttrain_jax.types import TrainState
fs = sys.argv[1]
state = TrainState(params={"w": jnp.ones(8)}, opt_state={}, step=jnp.int32(0),
                   rng=jax.random.key(0))
ck = Checkpointer(fs + "/ck", CheckpointConfig(async_save=True))
ck.save(1, state, {})
ck.wait()
subprocess.run(["mount", "-o", "remount,ro", fs], check=True)
try:
  ck.save(2, state, {})
  ck.wait()
except CheckpointWriteError as e:
  print(e)
  sys.exit(3)   # what the launcher does with a UserError: the process must end now
"""


def test_a_failed_async_save_lets_the_process_exit(small_fs):
  """The step directory cannot be made (read-only): orbax made it in its background, and its
  writer threads then waited 300 s for a "directory created" signal, so the process printed
  the error and hung 5 minutes before it exited. Now it exits in seconds."""
  fs = small_fs("1m")
  try:
    out = subprocess.run([sys.executable, "-c", _ASYNC_RO_SAVE, str(fs)], capture_output=True,
                         text=True, cwd=ROOT, timeout=90)
  except subprocess.TimeoutExpired:
    pytest.fail("the process did not exit within 90 s of a failed async checkpoint save")
  finally:
    subprocess.run(["mount", "-o", "remount,rw", str(fs)], capture_output=True)
  assert out.returncode == 3, out.stderr[-2000:]
  assert out.stdout.startswith(f"checkpoint {fs / 'ck' / '2'} was not written: read-only file "
                               "system (EROFS)"), out.stdout


@pytest.mark.parametrize("leave", [8 << 10, 96 << 10, 600 << 10])
def test_checkpoint_disk_full_midway_never_leaves_a_broken_latest(small_fs, leave):
  """The disk runs out part way through step 2's files (its array is 1 MB): whatever
  point it was, step 1 stays the latest, restores, and the step-2 temp dir is gone."""
  fs = small_fs("4m")
  ck = Checkpointer(fs / "ck", CheckpointConfig(every_steps=1, max_to_keep=1))
  _save(ck, 1, 1.0)
  with full(fs, leave=leave):
    with pytest.raises(CheckpointWriteError, match="no space left on device"):
      _save(ck, 2, 2.0, n=256 << 10)
    assert sorted(p.name for p in (fs / "ck").iterdir()) == ["1"]
  ck.close()
  _assert_restores(fs / "ck", 1, 1.0)


def test_checkpoint_directory_on_a_read_only_disk(small_fs):
  fs = small_fs("1m")
  with read_only(fs):
    with pytest.raises(CheckpointWriteError) as e:
      Checkpointer(fs / "run" / "checkpoints")
  assert str(e.value).startswith(f"cannot use checkpoint directory {fs / 'run' / 'checkpoints'}: "
                                 "read-only file system (EROFS)"), str(e.value)


# ------------------------------------------------------------------ metrics.jsonl

def test_metrics_rows_survive_a_full_disk(small_fs):
  """A row cut by ENOSPC is a torn last line: the next run keeps every complete row before
  it; the rewrite at resume on a full disk leaves the good file in place."""
  fs = small_fs("256k")
  w = MetricsWriter(fs, tensorboard=False)
  for s in range(3):
    w.write(s, {"loss": float(s)})
  good = (fs / "metrics.jsonl").read_bytes()
  with full(fs):
    with pytest.raises(DiskWriteError) as e:
      for s in range(3, 1000):
        w.write(s, {"loss": float(s), "pad": "x" * 1000})
    assert e.value.errno == errno.ENOSPC
    msg = str(e.value)
    assert msg.startswith(f"metrics {fs / 'metrics.jsonl'}: the row of step "), msg
    assert "no space left on device (ENOSPC)" in msg and "free there" in msg, msg
    assert "the complete rows before it are kept" in msg and "rerun the same command" in msg
    w.close()   # its buffer cannot be flushed either: reported by write() already
    rows = read_metrics(fs / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) >= 3
    with pytest.raises(DiskWriteError, match="cannot be opened for writing: no space left"):
      MetricsWriter(fs, tensorboard=False, resume_step=1)   # the rewrite cannot be written...
    assert (fs / "metrics.jsonl").read_bytes().startswith(good)   # ...nor replace the file
    assert not (fs / "metrics.jsonl.tmp").exists()
  w = MetricsWriter(fs, tensorboard=False, resume_step=2)
  w.write(3, {"loss": 3.0})
  w.close()
  assert [r["step"] for r in read_metrics(fs / "metrics.jsonl")] == [0, 1, 2, 3]


def test_a_run_on_a_read_only_workdir_is_one_clear_error(small_fs):
  from posttrain_jax.run import Trainer
  from tests.support.runs import tiny_run
  fs = small_fs("1m")
  with read_only(fs):
    with pytest.raises(DiskWriteError) as e:
      Trainer(tiny_run(fs / "run"), log=lambda *_: None)
  assert str(e.value) == (f"cannot use workdir {fs / 'run'}: read-only file system (EROFS); "
                          f"make {fs / 'run'} writable (or write elsewhere)")


def test_the_proxy_answers_507_when_its_trace_store_is_full(small_fs):
  """A call the store cannot record is refused with 507 and the store's message, never
  answered 200 unrecorded (nor a bare 500 'internal error'); with room again it records."""
  import openai
  from tests.support import byoh as bt
  from tests.support.byoh import openai_client, scripted_engine
  fs = small_fs("4m")
  with bt.running(scripted_engine(["4"]), fs / "t.db") as (url, proxy):
    client = openai_client(url, "s")
    ask = dict(model="posttrain_jax", max_tokens=8,
               messages=[{"role": "user", "content": "2+2? " + "pad " * (4 << 10)}])
    client.chat.completions.create(**ask)
    with full(fs):
      with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**ask)
    assert e.value.status_code == 507, e.value
    body = e.value.body
    assert body["code"] == "insufficient_storage" and body["type"] == "server_error", body
    assert "no space left on device (ENOSPC)" in body["message"], body
    assert str(fs / "t.db") in body["message"], body
    client.chat.completions.create(**ask)
    assert [c.status for c in proxy.store.calls("default", "s")] == ["complete"] * 2


# ------------------------------------------------------------------ HF export

@pytest.fixture(scope="module")
def two_models():
  return small_model(0), small_model(1)   # ~3 s each to build: once for the module


@pytest.mark.parametrize("kind", ["full", "read_only", "full_midway"])
def test_hf_export_fault_keeps_the_previous_export(small_fs, two_models, kind):
  old_model, new_model = two_models
  fs = small_fs("1m")
  out = fs / "final_model"
  hf_io.save_hf_model(old_model, out, max_shard_bytes=20_000)  # 3+ files
  before = _files(out)
  assert len([f for f in before if f.endswith(".safetensors")]) > 2
  fault = full(fs, leave=30_000) if kind == "full_midway" else _fault(kind, fs)
  with fault:
    with pytest.raises(DiskWriteError) as e:
      hf_io.save_hf_model(new_model, out, max_shard_bytes=20_000)
    msg = str(e.value)
    code = errno.EROFS if kind == "read_only" else errno.ENOSPC
    assert e.value.errno == code and isinstance(e.value, UserError)
    assert msg.startswith(f"{out} was not written: {CAUSE['read_only' if kind == 'read_only' else 'full']}"), msg
    assert f"the previous {out} is unchanged" in msg, msg
    if kind != "read_only":
      nbytes = sum(a.nbytes for _, a in hf_io.hf_tensors(new_model))
      assert f", about {nbytes} bytes to write, " in msg or f"({nbytes} bytes) to write, " in msg, msg
      assert " free there; " in msg, msg
    if kind == "full_midway":
      assert "(writing model-0000" in msg and ".safetensors)" in msg, msg   # the file it was writing
    if kind == "read_only":
      assert f"(creating a temporary directory in {fs})" in msg, msg
  assert _files(out) == before
  assert sorted(p.name for p in fs.iterdir()) == ["final_model"]   # no temp sibling left
  again = hf_io.load_hf_model(out)
  for (n1, a1), (n2, a2) in zip(hf_io.hf_tensors(old_model), hf_io.hf_tensors(again)):
    assert n1 == n2
    np.testing.assert_array_equal(a1, a2)


# ------------------------------------------------------------------ trace store

def _begin(store: TraceStore, i: int, pad: int = 0) -> None:
  store.begin_call(call_id=f"c{i}", tenant="t", session="s", kind="completion",
                   request={"prompt": "p" * pad}, prompt_text=f"prompt {i}",
                   prompt_ids=[1, 2, i], created=float(i))


def _end(store: TraceStore, i: int, pad: int = 0) -> None:
  store.end_call(f"c{i}", status="complete", finished=i + 0.5, latency_s=0.5, reason="r" * pad,
                 choices=[Choice(index=0, token_ids=[7, i], logprobs=[-0.25, -1.5],
                                 finish_reason="stop", version=0)])


def _stored(path: pathlib.Path) -> list[dict]:
  s = TraceStore(StoreConfig(path=str(path)))
  try:
    return [c.to_json() for c in s.calls("t")]
  finally:
    s.close()


def test_trace_store_on_a_full_disk(small_fs):
  fs = small_fs("512k")
  path = fs / "traces.db"
  store = TraceStore(StoreConfig(path=str(path)))
  for i in range(3):
    _begin(store, i)
  _end(store, 0)
  _end(store, 1)
  before = [c.to_json() for c in store.calls("t")]
  with full(fs):
    with pytest.raises(StoreWriteError) as e:
      _begin(store, 3, pad=64 << 10)
    msg = str(e.value)
    assert msg.startswith(f"trace store {path}: recording call c3 failed: no space left on device "
                          "(ENOSPC)"), msg
    assert "nothing of it was stored; what was stored before is intact" in msg
    assert isinstance(e.value, StoreError) and e.value.errno == errno.ENOSPC
    with pytest.raises(StoreWriteError, match="recording the end of call c2 failed"):
      _end(store, 2, pad=64 << 10)
    # no partial record: the same connection and a fresh one read exactly what was there
    assert [c.to_json() for c in store.calls("t")] == before
    assert _stored(path) == before
    assert store.call("c2").status == "incomplete" and store.call("c3") is None
  _begin(store, 3)   # room again: the store goes on
  _end(store, 2)
  assert [c.status for c in store.calls("t")] == ["complete"] * 3 + ["incomplete"]
  store.close()


def test_trace_import_on_a_full_disk_stores_nothing(small_fs, tmp_path):
  src = TraceStore(StoreConfig(path=str(tmp_path / "src.db")))
  for i in range(40):
    _begin(src, i, pad=4000)
    _end(src, i)
  src.export_jsonl(str(tmp_path / "calls.jsonl"))
  src.close()
  fs = small_fs("512k")
  store = TraceStore(StoreConfig(path=str(fs / "traces.db")))
  _begin(store, 100)
  with full(fs, leave=40_000):   # room for a few of the 40 records, not all
    with pytest.raises(StoreWriteError, match=f"importing {tmp_path / 'calls.jsonl'} failed: "
                                              "no space left on device"):
      store.import_jsonl(str(tmp_path / "calls.jsonl"))
    assert [c.id for c in store.calls("t")] == ["c100"]   # the import is all or nothing
  assert store.import_jsonl(str(tmp_path / "calls.jsonl")) == (40, [])
  store.close()


def test_trace_store_on_a_read_only_disk(small_fs):
  fs = small_fs("512k")
  path = fs / "traces.db"
  store = TraceStore(StoreConfig(path=str(path)))
  _begin(store, 0)
  store.close()
  with read_only(fs):
    with pytest.raises(StoreWriteError) as e:
      TraceStore(StoreConfig(path=str(path)))
    assert str(e.value).startswith(f"trace store {path}: opening failed: read-only file system "
                                   "(EROFS)"), str(e.value)   # not SQLite's "cannot open"
    assert "the store was not opened" in str(e.value)
  assert [c["id"] for c in _stored(path)] == ["c0"]


def test_trace_export_on_a_full_disk_keeps_the_previous_export(small_fs, tmp_path):
  store = TraceStore(StoreConfig(path=str(tmp_path / "t.db")))
  for i in range(20):
    _begin(store, i, pad=4000)
  fs = small_fs("256k")
  out = fs / "calls.jsonl"
  out.write_text("previous export\n")
  with full(fs, leave=20_000):
    with pytest.raises(StoreWriteError) as e:
      store.export_jsonl(str(out))
  assert str(e.value).startswith(f"trace export to {out} failed: no space left on device"), \
      str(e.value)
  assert out.read_text() == "previous export\n"
  assert sorted(p.name for p in fs.iterdir()) == ["calls.jsonl"]   # no .tmp left
  store.close()


def test_trace_export_to_a_read_only_disk_keeps_the_previous_export(small_fs, tmp_path):
  """The temporary file cannot be made, nor (EROFS even for a missing file) unlinked: the
  error is still the export's, not the cleanup's."""
  store = TraceStore(StoreConfig(path=str(tmp_path / "t.db")))
  _begin(store, 0)
  fs = small_fs("256k")
  out = fs / "calls.jsonl"
  out.write_text("previous export\n")
  with read_only(fs):
    with pytest.raises(StoreWriteError) as e:
      store.export_jsonl(str(out))
  assert str(e.value).startswith(f"trace export to {out} failed: read-only file system (EROFS); "
                                 f"{out} is as it was; make {fs} writable"), str(e.value)
  assert e.value.errno == errno.EROFS
  assert out.read_text() == "previous export\n"
  assert sorted(p.name for p in fs.iterdir()) == ["calls.jsonl"]
  store.close()


# ------------------------------------------------------------------ weight-sync buffer (/dev/shm)

_PACK = """
import sys, numpy as np
from posttrain_jax.engines import vllm_worker
from posttrain_jax.errors import DiskWriteError
path, n = sys.argv[1], int(sys.argv[2])
if path.endswith("/"):  # a directory: the engine names its own buffer file there
  from posttrain_jax.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
  engine = VLLMEngine.__new__(VLLMEngine)   # no vLLM here: only the buffer's placement
  engine.cfg, engine._shm = VLLMEngineConfig(shm_dir=path.rstrip("/")), None
  path = engine._shm_file()
try:
  print(vllm_worker.pack_file(path, [("w", np.full(n, 0.5, np.float32))]))
except DiskWriteError as e:
  print(e)
  sys.exit(3 if e.errno == 28 else 4)
"""


def _pack(path, n: int) -> str:
  """pack_file of an n-float32 buffer at `path`, in a child (a SIGBUS kills it, not the test
  run): its printout (the size, or the error)."""
  out = subprocess.run([sys.executable, "-c", _PACK, str(path), str(n)], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
  assert out.returncode != -signal.SIGBUS, "died with SIGBUS: the buffer was not allocated first"
  assert out.returncode in (0, 3, 4), (out.returncode, out.stderr[-2000:])
  return out.stdout.strip()


def test_weight_buffer_too_big_for_its_tmpfs_is_an_error_not_sigbus(small_fs):
  """A 4 MB buffer into a 1 MB tmpfs (docker's small /dev/shm): an error naming the path,
  the bytes needed and free, and the fixes. Before, the process died with SIGBUS (exit -7)
  and no message."""
  fs = small_fs("1m")
  path = fs / "ptj-weights.safetensors"
  msg = _pack(path, 1 << 20)
  assert msg.startswith(f"weight-sync buffer {path}: needs 4.19 MB (4194384 bytes), but {fs} "
                        "(a file system of 1.05 MB (1048576 bytes)) has 1.05 MB (1048576 bytes) "
                        "free."), msg
  for fix in ("--shm-size", "config.rl.engine_config.shm_dir", "weight_transport='bytes'"):
    assert fix in msg, msg
  assert list(fs.iterdir()) == []   # the file it created is gone, its pages given back
  header, _, total = vllm_worker.pack_layout([("w", np.zeros(200 << 10, np.float32))])
  assert _pack(path, 200 << 10) == str(len(header) + total)   # 800 kB: the room is really there


def test_weight_buffer_reuse_counts_its_own_pages(small_fs):
  """A buffer rewritten in place needs no new room: a 600 kB update into a 1 MB tmpfs with
  only its own 600 kB left works, and the bytes read back; a bigger one is refused (ENOSPC,
  not SIGBUS) and the file keeps its size and is readable."""
  fs = small_fs("1m")
  path = str(fs / "w.safetensors")
  a = np.arange(150 << 10, dtype=np.float32)
  size = vllm_worker.pack_file(path, [("w", a)])
  with full(fs):
    assert os.statvfs(fs).f_bavail == 0
    vllm_worker.pack_file(path, [("w", a[::-1].copy())])
    with open(path, "rb") as f:
      t = vllm_worker.unpack_torch(bytearray(f.read()))
    np.testing.assert_array_equal(t[0][1].numpy(), a[::-1])
    msg = _pack(path, 300 << 10)
    assert msg.startswith(f"weight-sync buffer {path}: needs 1.23 MB (1228880 bytes), but {fs} ")
    held = os.stat(path).st_blocks * 512   # whole pages: 151 of 4 kB
    assert f"has 0 bytes free + {held} bytes this buffer already holds" in msg, msg
    assert os.path.getsize(path) == size
    assert _pack(path, 150 << 10) == str(size)   # the same size again: still fits


def test_weight_buffer_on_a_read_only_disk(small_fs):
  fs = small_fs("1m")
  path = fs / "w.safetensors"
  with read_only(fs):
    msg = _pack(path, 1024)
  assert msg.startswith(f"weight-sync buffer {path}: cannot create it: read-only file system "
                        "(EROFS); point VLLMEngineConfig.shm_dir"), msg


def test_the_engine_puts_its_buffer_in_shm_dir(small_fs):
  """`VLLMEngineConfig.shm_dir` (the fix the message names) is where the engine's buffer goes:
  a small one is refused naming that directory (the engine's file helper, without vLLM)."""
  fs = small_fs("1m")
  msg = _pack(f"{fs}/", 1 << 20)
  assert msg.startswith(f"weight-sync buffer {fs}/ptj-weights-"), msg
  assert f"needs 4.19 MB (4194384 bytes), but {fs} (a file system of" in msg, msg
  assert list(fs.iterdir()) == []


def test_disk_errors_survive_pickling():
  """A process pool or a multi-process launcher sends the error back pickled: OSError's own
  pickling would call __init__(errno, message) and break str()."""
  import pickle
  for cls in (DiskWriteError, CheckpointWriteError, StoreWriteError):
    e = pickle.loads(pickle.dumps(cls("checkpoint /x/2 was not written: ...", errno.ENOSPC)))
    assert type(e) is cls and str(e) == "checkpoint /x/2 was not written: ..." and e.errno == 28
