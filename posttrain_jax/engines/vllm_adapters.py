"""The LoRA adapters a vLLM engine (vllm_engine.py) serves: each update's files and request.

`VLLMEngine(cfg, lora=LoRAConfig)` (the run passes the learner's when `adapter_sync`) starts vLLM
with `enable_lora` (max_lora_rank: the smallest vLLM allows >= r) on the start weights. An
`update_weights(model with adapters, v)` writes the adapters alone in PEFT's format
(models/peft_io.py: [r, in] + [out, r] per projection, ~2r(in + out) floats instead of in·out)
to a new directory under `shm_dir`, has vLLM load them (`add_lora`, so a bad adapter fails the
update, not the next rollout) and serves every later request with that adapter. Each update
gets a NEW adapter name and id: vLLM caches a loaded adapter by id and keys its prefix cache by
name (and path), so a reused name or id would serve the old adapter or KV computed with it. The
base never changes, so the prefix cache is not reset (cached blocks of the base and of older
adapters are simply never matched again); the previous adapter is removed from vLLM and from
disk. Weights given as a model without adapters or as `(HF name, array)` pairs still replace
the base the old way (the adapter is then dropped). A restarted core loads the current adapter
again from its files.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
import weakref
from typing import Optional

from posttrain_jax.engines.base import EngineError


class AdapterFiles:
  """One engine's adapter directory: each update's PEFT files and its vLLM `LoRARequest`, with
  an id (> 0) and a name never used before, by this engine or another (the directory and every
  file in it are removed at `close()` or at exit)."""

  def __init__(self, shm_dir: str, alpha: float, base_model: str):
    self._shm_dir, self._alpha, self._base_model = shm_dir, alpha, base_model
    self._dir: Optional[tuple] = None   # (path, finalizer)
    self._serial = 0
    self._uid = uuid.uuid4().hex[:8]

  def write(self, model, version: int):
    """`model`'s adapters as the files of a new request: (request, tensors, bytes written)."""
    from vllm.lora.request import LoRARequest

    from posttrain_jax.models import peft_io
    tensors = peft_io.peft_tensors(model)
    config = peft_io.adapter_config(model, alpha=self._alpha,
                                    base_model_name_or_path=self._base_model)
    self._serial += 1
    path = os.path.join(self.directory(), f"v{version}-{self._serial}")
    os.makedirs(path)
    try:
      nbytes = peft_io.write_adapter(path, tensors, config)
    except OSError as e:
      shutil.rmtree(path, ignore_errors=True)
      raise EngineError(f"LoRA adapter of version {version}: cannot write {path} ({e}); point "
                        "VLLMEngineConfig.shm_dir at a writable directory with room") from e
    request = LoRARequest(lora_name=f"ptj-{self._uid}-v{version}-{self._serial}",
                          lora_int_id=self._serial, lora_path=path)
    return request, len(tensors), nbytes

  @staticmethod
  def remove(request) -> None:
    shutil.rmtree(request.lora_path, ignore_errors=True)

  def close(self) -> None:
    if self._dir is not None:
      self._dir[1]()
      self._dir = None

  def directory(self) -> str:
    """The directory holding the adapters' files (made on first use)."""
    if self._dir is None:
      d = self._shm_dir if os.path.isdir(self._shm_dir) else tempfile.gettempdir()
      path = tempfile.mkdtemp(prefix=f"ptj-lora-{os.getpid()}-", dir=d)
      self._dir = (path, weakref.finalize(self, shutil.rmtree, path, True))
    return self._dir[0]
