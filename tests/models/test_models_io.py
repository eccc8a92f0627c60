"""One safetensors header parser / encoder and one atomic directory writer, used everywhere.

The header code is checked against the `safetensors` package (the format's reference
implementation): files and buffers we write, it reads, and the other way round.
"""
import json
import pathlib
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from posttrain_jax.engines import vllm_worker
from posttrain_jax.models.fsutil import atomic_directory
from posttrain_jax.models.safetensors_io import (SafetensorsError, SafetensorsFile, read_header,
                                                 write_safetensors)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _arrays():
  rng = np.random.default_rng(0)
  return {"a.weight": rng.standard_normal((3, 5)).astype(np.float32),
          "b.bias": rng.standard_normal(7).astype(ml_dtypes.bfloat16),
          "c.ids": np.arange(4, dtype=np.int64)}


def test_written_file_reads_in_the_reference_and_back(tmp_path):
  arrays = _arrays()
  write_safetensors(tmp_path / "x.safetensors", arrays.items(), metadata={"step": "3"})
  ref = safetensors.numpy.load_file(tmp_path / "x.safetensors")
  for k, v in arrays.items():
    np.testing.assert_array_equal(ref[k].view(np.uint8), v.view(np.uint8))
  f = SafetensorsFile(tmp_path / "x.safetensors")
  assert f.metadata == {"format": "pt", "step": "3"}
  for k, v in arrays.items():
    np.testing.assert_array_equal(f.get(k).view(np.uint8), v.view(np.uint8))


def test_reference_file_reads_here(tmp_path):
  arrays = {k: v for k, v in _arrays().items() if v.dtype != ml_dtypes.bfloat16}
  safetensors.numpy.save_file(arrays, tmp_path / "r.safetensors", metadata={"m": "1"})
  header = read_header(tmp_path / "r.safetensors")
  assert header.metadata == {"m": "1"}
  assert {k: tuple(v["shape"]) for k, v in header.tensors.items()} == {
      k: v.shape for k, v in arrays.items()}
  f = SafetensorsFile(tmp_path / "r.safetensors")
  for k, v in arrays.items():
    np.testing.assert_array_equal(f.get(k), v)


def test_path_and_buffer_parse_the_same(tmp_path):
  buf = vllm_worker.pack_bytes(_arrays().items())
  (tmp_path / "w.safetensors").write_bytes(buf)
  assert read_header(buf) == read_header(tmp_path / "w.safetensors")
  plain = {k: v for k, v in _arrays().items() if v.dtype != ml_dtypes.bfloat16}
  ref = safetensors.numpy.load(bytes(vllm_worker.pack_bytes(plain.items())))  # a valid file
  for k, v in plain.items():
    np.testing.assert_array_equal(ref[k], v)


def _raw(header: dict, data: bytes = b"") -> bytes:
  blob = json.dumps(header).encode()
  return struct.pack("<Q", len(blob)) + blob + data


@pytest.mark.parametrize("raw, message", [
    (b"\x05", "not a readable safetensors file"),
    (struct.pack("<Q", 1 << 40) + b"{}",
     r"not a readable safetensors file \(header length 1099511627776 exceeds the file size 10\)"),
    (_raw([1, 2]), r"not a readable safetensors file \(the header is not a JSON object\)"),
    (_raw({"t": {"dtype": "F32", "shape": [4]}}), "not a readable safetensors file"),
    (_raw({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
     r"truncated \(\d+ bytes, its header needs \d+\)"),
])
def test_malformed_header_named(tmp_path, raw, message):
  (tmp_path / "bad.safetensors").write_bytes(raw)
  with pytest.raises(SafetensorsError, match=r"bad\.safetensors: " + message):
    read_header(tmp_path / "bad.safetensors")
  with pytest.raises(SafetensorsError, match=r"weights: " + message):
    read_header(raw, name="weights")


def test_vllm_worker_still_imports_without_jax():
  code = ("import sys, posttrain_jax.engines.vllm_worker; "
          "bad = [m for m in ('jax', 'flax') if m in sys.modules]; assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def _listing(d: pathlib.Path):
  return sorted(p.name for p in d.iterdir())


def test_atomic_directory_creates_and_replaces(tmp_path):
  out = tmp_path / "ckpt"
  with atomic_directory(out) as tmp:
    (tmp / "a").write_text("1")
    assert not out.exists()
  assert _listing(out) == ["a"]
  with atomic_directory(out) as tmp:
    (tmp / "b").write_text("2")
  assert _listing(out) == ["b"] and _listing(tmp_path) == ["ckpt"]


def test_atomic_directory_failure_leaves_the_old_one(tmp_path):
  out = tmp_path / "ckpt"
  out.mkdir()
  (out / "a").write_text("old")
  with pytest.raises(RuntimeError):
    with atomic_directory(out) as tmp:
      (tmp / "half").write_text("x")
      raise RuntimeError("crash mid-write")
  assert _listing(out) == ["a"] and _listing(tmp_path) == ["ckpt"]


def test_atomic_directory_failed_rename_puts_the_old_one_back(tmp_path, monkeypatch):
  out = tmp_path / "ckpt"
  out.mkdir()
  (out / "a").write_text("old")
  real = pathlib.Path.rename

  def rename(self, target):
    if pathlib.Path(target) == out and self.name != ".ckpt.old":  # installing the new one fails
      raise OSError("disk gone")
    return real(self, target)

  monkeypatch.setattr(pathlib.Path, "rename", rename)
  with pytest.raises(OSError, match="disk gone"):
    with atomic_directory(out) as tmp:
      (tmp / "b").write_text("new")
  monkeypatch.undo()
  assert (out / "a").read_text() == "old" and _listing(tmp_path) == ["ckpt"]


def test_worker_unpacks_the_buffer_it_was_sent():
  torch = pytest.importorskip("torch")
  arrays = _arrays()
  got = dict(vllm_worker.unpack_torch(vllm_worker.pack_bytes(arrays.items())))
  assert list(got) == list(arrays)
  np.testing.assert_array_equal(got["a.weight"].numpy(), arrays["a.weight"])
  np.testing.assert_array_equal(got["c.ids"].numpy(), arrays["c.ids"])
  assert got["b.bias"].dtype == torch.bfloat16
  np.testing.assert_array_equal(got["b.bias"].float().numpy(), arrays["b.bias"].astype(np.float32))
