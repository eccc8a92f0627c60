"""Embedded sampler: batched, jitted decoding with a KV cache on the learner's own params.

Prompts are left-padded to a bucketed length P (padding has segment id 0, so it is never
attended); one jitted call runs the prefill of each distinct prompt once and replicates its KV
cache and first logits n times (the n rows of a prompt would compute the same prefill: a
group of 8 costs one prompt forward, not 8), a second a `while_loop` of
single-token steps until every row has sampled a stop token, `max_tokens` tokens, or the
segment's end (below).

Compiled once per shape, not per request. Temperature, top-p, top-k and the stop ids are array
arguments of the programs (engines/sampling.py: greedy is a `jnp.where`, truncation a
`lax.cond`), and the decode buffers are `length_bucket(max_tokens)` long (the next power of
two), the loop stopping at max_tokens itself: a harness that varies its options reuses one
program per (batch bucket, prompt bucket, length bucket, n, top_logprobs > 0). `top_logprobs`
compiles as 0 or `max_top_logprobs` (more when asked) and is cut on the host.
`compiles` counts the programs this engine traced (jit cache misses: the traced bodies bump
it, and they run once per compile).

Limits. A prompt has 1..min(`max_prompt_len`, context - 1) tokens and prompt + max_tokens is at
most the model's context (`max_position_embeddings`); past them a `PromptTooLongError` names
the prompt or, for the sum, `max_tokens` (`param`), and the proxy answers a 400 naming it.

Sharing the device. The decode runs in segments of `segment_tokens` steps, each a turn at the
device (engines/turns.py: first come, first served), so a short request that arrives while a
long one decodes waits for one segment of it, not its whole answer; on CPU, where XLA runs
the threads' programs side by side, no turns are taken by default. Segments do not change what
is sampled: the same programs on the same random stream (`stream` is the same loop, reading
the tokens between its chunks).

Returned log-probs: for temperature tau > 0, `log softmax(z / tau)[y]` -- the temperature-
scaled distribution *before* top-k / top-p truncation, which is exactly what the learner
computes at the same temperature (and exactly the sampling distribution when top_k = 0 and
top_p = 1). For greedy decoding (tau = 0) they are `log softmax(z)[y]`.
With `SamplingParams.top_logprobs = k`, each step also returns the k largest entries of that
same log-prob vector (`jax.lax.top_k`, ids and values): the alternatives the OpenAI API's
`top_logprobs` reports. Under greedy decoding the first of them is the sampled token, with its
log-prob. Constrained decoding (`response_format`) is not implemented (`guided_decoding` False).

Several processes (a multi-host job; the params are sharded over every process's devices):
decoding is one SPMD program the whole job runs, so `generate` is a collective that every
process calls the same number of times, each with its own prompts (possibly none). The
processes' prompts are gathered and interleaved — the j-th prompt of process 0, of process 1,
..., then the (j+1)-th — which, with the task bank's strided shards
(`[process_index::process_count]`), is the order one process would have drawn them in; the job
decodes them together with process 0's seed and each process keeps its own completions.
There the decode is one segment and takes no turns (every process runs the same programs).
Only the synchronous single-turn rollouts and the held-out eval call it that way (one call per
step on every process); asynchronous or multi-turn rollouts across processes need an engine
per process (vLLM), and the trainer refuses the embedded one there.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import threading
from typing import Any, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain_jax.engines.base import Completion, PromptTooLongError, SamplingParams
from posttrain_jax.engines.registry import EngineContext, register_engine
from posttrain_jax.engines.sampling import length_bucket, sample
from posttrain_jax.engines.turns import Turns
from posttrain_jax.models.decoder import Decoder, KVCache, init_cache
from posttrain_jax.models.weights import as_params
from posttrain_jax.multihost import all_gather_json, put_global


@dataclasses.dataclass(frozen=True)
class JaxSamplerConfig:
  """Shapes the sampler compiles for (bucketing keeps recompiles rare), and how requests share
  the device."""
  max_prompt_len: int = 256       # longer prompts are an error naming the prompt (so are those
                                  # the model's context cannot hold with max_tokens: docstring)
  prompt_bucket: int = 16         # prompt length is padded up to a multiple of this
  batch_bucket: int = 8           # rows are padded up to a multiple of this
  pad_id: int = 0                 # id written into padding slots (never attended)
  segment_tokens: int = 32        # decode steps per turn at the device; a longer answer is
                                  # decoded in segments, other requests' between (0 = one segment)
  turns: int = 0                  # programs run at once, in FIFO turns (engines/turns.py);
                                  # 0 = 1 on an accelerator, no limit (no turns) on CPU


def _round_up(x: int, m: int) -> int:
  return max(m, int(math.ceil(x / m)) * m)


def _prefill(model: Decoder, prompt_bp, seg_bp, rng, filler_b, n: int, t_max: int, k_top: int):
  """The decode state after the prompt: (step, cache, logits, tokens, logps, lengths, done,
  rng, pos, top_ids, top_logps), for the n copies of each of the `prompt_bp` rows (row i of
  the state is prompt i // n), with room for `t_max` tokens. Filler rows (`filler_b`: the batch
  bucket's padding) start done, so the loop ends when the real rows have stopped (each row's
  draws do not depend on the others')."""
  u, p = prompt_bp.shape
  b = u * n
  cache = init_cache(model.cfg, u, p + t_max)
  pos_bp = jnp.maximum(jnp.cumsum(seg_bp, axis=1) - 1, 0)
  hidden, cache = model(prompt_bp, pos_bp, seg_bp, cache)
  rep = lambda x: jnp.repeat(x, n, axis=0) if n > 1 else x
  cache = KVCache(k=tuple(map(rep, cache.k)), v=tuple(map(rep, cache.v)),
                  segment_ids=rep(cache.segment_ids), index=cache.index)
  return (jnp.zeros((), jnp.int32), cache, rep(model.logits(hidden[:, -1])),
          jnp.zeros((b, t_max), jnp.int32), jnp.zeros((b, t_max), jnp.float32),
          jnp.zeros((b,), jnp.int32), filler_b, rng, rep(jnp.sum(seg_bp, axis=1)),
          jnp.zeros((b, t_max, k_top), jnp.int32),
          jnp.zeros((b, t_max, k_top), jnp.float32))


def _decode(model: Decoder, carry, until, knobs):
  """Single-token steps from `carry` until step `until` or every row has stopped; `knobs` =
  (temperature_b, top_p_b, top_k_b, stop_ids_s) (stop ids padded with -1)."""
  temperature_b, top_p_b, top_k_b, stops_s = knobs
  k_top = carry[9].shape[-1]

  def cond(carry):
    step, done = carry[0], carry[6]
    return (step < until) & ~jnp.all(done)

  def body(carry):
    step, cache, logits, tokens, logps, lengths, done, rng, pos, top_ids, top_lps = carry
    rng, sub = jax.random.split(rng)
    ids, lp, t_ids, t_lps = sample(logits, sub, temperature_b, top_p_b, top_k_b, k_top)
    live = ~done
    tokens = tokens.at[:, step].set(jnp.where(live, ids, 0))
    logps = logps.at[:, step].set(jnp.where(live, lp, 0.0))
    top_ids = top_ids.at[:, step].set(jnp.where(live[:, None], t_ids, 0))
    top_lps = top_lps.at[:, step].set(jnp.where(live[:, None], t_lps, 0.0))
    lengths = lengths + live
    done = done | (live & jnp.isin(ids, stops_s))
    hidden, cache = model(ids[:, None], pos[:, None], live.astype(jnp.int32)[:, None], cache)
    return (step + 1, cache, model.logits(hidden[:, 0]), tokens, logps, lengths, done, rng,
            pos + 1, top_ids, top_lps)

  return jax.lax.while_loop(cond, body, carry)


# Two programs: the prefill, then the steps until a given step (a segment). Both `generate` and
# `stream` run them on the same random stream, so a stream samples what a whole answer does.
# The decode state (KV cache included) stays on the device between the calls. The traced
# bodies count compiles: they run once per jit cache miss.
@functools.partial(jax.jit, static_argnames=("graphdef", "n", "t_max", "k_top"))
def _start(graphdef: "_Static", params, prompt_bp, seg_bp, rng, filler_b, *, n: int,
           t_max: int, k_top: int):
  graphdef.compiled()
  return _prefill(nnx.merge(graphdef.value, params), prompt_bp, seg_bp, rng, filler_b, n,
                  t_max, k_top)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnums=(2,))
def _continue(graphdef: "_Static", params, carry, until, knobs):
  graphdef.compiled()
  return _decode(nnx.merge(graphdef.value, params), carry, until, knobs)


class _Static:
  """A graphdef as a jit static argument, hashed once: hashing an nnx GraphDef walks the whole
  module tree (~0.25 ms a call on the tiny model, more than a decode step). Equal graphdefs
  share compiled programs; `compiles` counts those traced with this one (one per engine)."""

  def __init__(self, value):
    self.value, self._hash = value, hash(value)
    self.compiles = 0
    self._lock = threading.Lock()

  def compiled(self) -> None:
    with self._lock:
      self.compiles += 1

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other) -> bool:
    return self is other or (isinstance(other, _Static) and self._hash == other._hash
                             and self.value == other.value)


class JaxSampler:
  """The default engine: decodes with the learner's params in this process."""

  max_top_logprobs = 20           # capabilities (engines/base.py): top-k alternatives, yes
  guided_decoding = False         # constrained decoding (response_format), no

  def __init__(self, model: Decoder, cfg: JaxSamplerConfig = JaxSamplerConfig(), version: int = 0):
    self.cfg = cfg
    self.context_len = int(model.cfg.max_position_embeddings)  # capability: prompt + answer
    self._graphdef, params = nnx.split(model, nnx.Param)
    self._static = _Static(self._graphdef)
    self._params = params
    self._version = version
    self._lock = threading.Lock()
    slots = cfg.turns or (None if jax.default_backend() == "cpu" else 1)
    self._turns = Turns(slots)

  @property
  def version(self) -> int:
    return self._version

  @property
  def compiles(self) -> int:
    """Sampling programs this engine compiled (jit cache misses) so far."""
    return self._static.compiles

  def _snapshot(self):
    with self._lock:
      return self._params, self._version

  def update_weights(self, weights: Any, version: int) -> None:
    """`weights`: a model or its nnx.Param state (same structure). No copy is made."""
    weights = as_params(weights)
    with self._lock:  # a generate() already running keeps the pair it read
      self._params, self._version = weights, version

  def fork(self) -> "JaxSampler":
    """Another engine on this one's compiled programs and device share (`compiles` and the
    turns are common), with a weights slot of its own, starting with this one's (params,
    version): one tenant's adapters on the shared base (byoh/tenant_source.py)."""
    twin = copy.copy(self)
    twin._params, twin._version = self._snapshot()
    twin._lock = threading.Lock()
    return twin

  def _check(self, prompts: Sequence[Sequence[int]], seed: Optional[int],
             sampling: SamplingParams) -> int:
    if sampling.response_format is not None:
      raise ValueError("JaxSampler cannot constrain decoding (SamplingParams.response_format); "
                       "use an engine with guided_decoding (vllm)")
    if sampling.max_tokens < 1:
      raise ValueError(f"SamplingParams.max_tokens={sampling.max_tokens}; at least 1")
    ctx = self.context_len
    most = min(self.cfg.max_prompt_len, ctx - 1)
    why = ("JaxSamplerConfig.max_prompt_len" if most == self.cfg.max_prompt_len else
           f"the model's context of {ctx} tokens, max_position_embeddings, less one to answer")
    for i, prompt in enumerate(prompts):
      if not 0 < len(prompt) <= most:
        raise PromptTooLongError(i, f"prompt {i} has {len(prompt)} tokens; the sampler accepts "
                                 f"1..{most} ({why})")
      if len(prompt) + sampling.max_tokens > ctx:
        raise PromptTooLongError(
            i, f"max_tokens={sampling.max_tokens} with prompt {i} of {len(prompt)} tokens "
            f"exceeds the model's context of {ctx} tokens (max_position_embeddings); ask for at "
            f"most {ctx - len(prompt)}", param="max_tokens")
    return int(np.random.SeedSequence(seed).generate_state(1)[0] if seed is not None
               else np.random.randint(2**31))

  def _layout(self, rows: list[list[int]], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded ids and segment ids of the distinct prompts `rows`, each to be decoded n
    times: ceil(B / n) rows, B = the n·len(rows) decode rows rounded up to the batch bucket."""
    b = -(-_round_up(len(rows) * n, self.cfg.batch_bucket) // n)
    p = _round_up(max(len(r) for r in rows), self.cfg.prompt_bucket)
    ids = np.full((b, p), self.cfg.pad_id, np.int32)
    seg = np.zeros((b, p), np.int32)
    for r, row in enumerate(rows):
      ids[r, p - len(row):] = row
      seg[r, p - len(row):] = 1
    seg[len(rows):, -1] = 1  # filler rows decode a pad token; their output is dropped
    return ids, seg

  def _segments(self, params, ids, seg, seed: int, real: int, n: int, sampling: SamplingParams,
                every: int) -> Iterator[tuple[Any, int, int, bool]]:
    """Decodes in segments of `every` steps, each one turn at the device (module docstring);
    yields (carry, first step, end step, last) after each. One process only: the job's
    lockstep decode (several processes) is one segment, no turns, no reads between."""
    lockstep = jax.process_count() > 1
    every = sampling.max_tokens if lockstep or every <= 0 else every
    inputs = _inputs(params, ids, seg, seed, real, n, _knobs(sampling, ids.shape[0] * n))
    k_top = 0 if sampling.top_logprobs == 0 else max(sampling.top_logprobs,
                                                     self.max_top_logprobs)
    carry, step = None, 0
    while True:
      prev, step = step, min(step + every, sampling.max_tokens)
      with contextlib.nullcontext() if lockstep else self._turns.turn():
        if carry is None:
          carry = _start(self._static, params, *inputs[:4], n=n,
                         t_max=length_bucket(sampling.max_tokens), k_top=k_top)
        carry = _continue(self._static, params, carry, step, inputs[4])
        # the turn lasts until the device has done the segment (reading waits for it)
        stopped = False if lockstep else bool(np.all(jax.device_get(carry[6])))
      last = stopped or step >= sampling.max_tokens
      yield carry, prev, step, last
      if last:
        return

  def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, n: int = 1,
               seed: Optional[int] = None) -> list[list[Completion]]:
    """G = n completions of each prompt. Several processes: a collective (module docstring)."""
    seed = self._check(prompts, seed, sampling)
    mine = list(range(len(prompts)))
    if jax.process_count() > 1:
      prompts, mine, seed = _job_prompts(prompts, n, seed)
    if not prompts:
      return []
    ids, seg = self._layout([list(p) for p in prompts], n)
    rows = len(prompts) * n
    # Params and version are read together once: weights installed by another thread while this
    # call decodes do not relabel its tokens with the newer version.
    params, version = self._snapshot()
    for carry, *_ in self._segments(params, ids, seg, seed, rows, n, sampling,
                                    self.cfg.segment_tokens):
      pass
    k = sampling.top_logprobs
    fetched = _fetch((*carry[3:7], *carry[9:11]) if k else carry[3:7])
    tokens, logps, lengths, done = fetched[:4]
    top_ids, top_lps = (fetched[4][..., :k], fetched[5][..., :k]) if k else (None, None)
    out = []
    for r in range(rows):
      n_tok = int(lengths[r])
      out.append(Completion(token_ids=tokens[r, :n_tok].tolist(),
                            logprobs=logps[r, :n_tok].astype(float).tolist(),
                            finish_reason="stop" if done[r] else "length",
                            version=version,
                            top_logprobs=_tops(top_ids, top_lps, r, 0, n_tok)))
    return [out[i * n:(i + 1) * n] for i in mine]

  def stream(self, prompt: Sequence[int], sampling: SamplingParams, n: int = 1,
             seed: Optional[int] = None, chunk_tokens: int = 4,
             cancelled: Optional[threading.Event] = None) -> Iterator[list[Completion]]:
    """The n completions of one prompt as they grow: after every `chunk_tokens` decode steps
    (a segment: one turn at the device), the completions so far (finish_reason "" while a row
    still decodes); the last item is final, and it is what `generate([prompt], sampling, n,
    seed)[0]` returns -- the same programs' steps, the same random stream
    (tests/engines/test_jax_sampler_stream.py). Stops early (nothing more is yielded) once
    `cancelled` is set. One process only."""
    if jax.process_count() > 1:
      raise NotImplementedError("JaxSampler.stream runs in one process (the proxy's)")
    seed = self._check([prompt], seed, sampling)
    ids, seg = self._layout([list(prompt)], n)
    params, version = self._snapshot()
    toks: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    tops: list[list] = [[] for _ in range(n)]
    k = sampling.top_logprobs
    for carry, prev, step, last in self._segments(params, ids, seg, seed, n, n, sampling,
                                                  max(chunk_tokens, 1)):
      # only this chunk's columns come to the host (a row's tokens end at its length)
      tokens, logps, lengths, done, top_ids, top_lps = jax.device_get(
          (carry[3][:n, prev:step], carry[4][:n, prev:step], carry[5][:n], carry[6][:n],
           carry[9][:n, prev:step, :k] if k else None,
           carry[10][:n, prev:step, :k] if k else None))
      for r in range(n):
        m = int(lengths[r]) - len(toks[r])
        toks[r] += tokens[r, :m].tolist()
        lps[r] += logps[r, :m].astype(float).tolist()
        if k:
          tops[r] += _tops(top_ids, top_lps, r, 0, m)
      yield [Completion(token_ids=list(toks[r]), logprobs=list(lps[r]),
                        finish_reason="stop" if done[r] else ("length" if last else ""),
                        version=version, top_logprobs=list(tops[r]) if k else None)
             for r in range(n)]
      if last or (cancelled is not None and cancelled.is_set()):
        return


def _knobs(sp: SamplingParams, rows: int):
  """The traced sampling values of `rows` decode rows: (temperature_b, top_p_b, top_k_b,
  stop ids padded with -1 to a multiple of 8, so a new stop set rarely compiles)."""
  stops = np.full((_round_up(len(sp.stop_token_ids), 8),), -1, np.int32)
  stops[:len(sp.stop_token_ids)] = sp.stop_token_ids
  return (np.full((rows,), sp.temperature, np.float32), np.full((rows,), sp.top_p, np.float32),
          np.full((rows,), sp.top_k, np.int32), stops)


def _tops(top_ids, top_lps, r: int, lo: int, hi: int) -> Optional[list[list[tuple[int, float]]]]:
  """Row r's alternatives at positions lo..hi-1 as (id, log-prob) lists; None when not asked."""
  if top_ids is None:
    return None
  return [list(zip(top_ids[r, t].tolist(), top_lps[r, t].astype(float).tolist()))
          for t in range(lo, hi)]


def _job_prompts(prompts, n: int, seed: int) -> tuple[list[list[int]], list[int], int]:
  """(every process's prompts interleaved, the positions of this process's among them,
  process 0's seed): see the module docstring."""
  everyone = all_gather_json({"prompts": [[int(t) for t in p] for p in prompts], "n": n,
                              "seed": seed})
  if len({e["n"] for e in everyone}) > 1:
    raise ValueError(f"generate: the processes asked for different n {[e['n'] for e in everyone]}")
  longest = max(len(e["prompts"]) for e in everyone)
  order = [(i, j) for j in range(longest) for i, e in enumerate(everyone) if j < len(e["prompts"])]
  me = jax.process_index()
  return ([everyone[i]["prompts"][j] for i, j in order],
          [k for k, (i, _) in enumerate(order) if i == me], everyone[0]["seed"])


def _inputs(params, ids, seg, seed: int, real: int, n: int, knobs):
  """(prompt ids, segment ids, PRNG key, filler rows, knobs) for `_start` / `_continue` (of the
  n·len(ids) decode rows, those past `real` are fillers); several processes: laid out
  replicated over the params' mesh (this process's arrays alone cannot enter a job's program)."""
  rng = jax.random.key(seed)
  filler = np.arange(ids.shape[0] * n) >= real
  if jax.process_count() == 1:
    return ids, seg, rng, filler, knobs
  mesh = next(x.sharding.mesh for x in jax.tree.leaves(params)
              if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return put_global((ids, seg, rng, filler, knobs), (rep, rep, rep, rep, (rep,) * 4))


def _fetch(arrays):
  """The decode's outputs on this host (several processes: gathered from the job's devices)."""
  if jax.process_count() == 1:
    return jax.device_get(arrays)
  from jax.experimental import multihost_utils
  return [np.asarray(multihost_utils.process_allgather(x, tiled=True)) if not x.is_fully_addressable
          else np.asarray(x) for x in arrays]


def _check(cfg: JaxSamplerConfig, model_config, max_tokens: int, *,
           field: str = "config.rl.engine_config", serving: bool = False) -> None:
  """Before training: the model's context holds max_tokens and a prompt (serving: each call is
  checked instead, a 400 naming max_tokens)."""
  del cfg, field
  limit = model_config.max_position_embeddings
  if not serving and max_tokens >= limit:
    from posttrain_jax.config_io import ConfigTypeError
    raise ConfigTypeError(f"max_tokens={max_tokens} leaves no room for a prompt in the model's "
                          f"context of {limit} tokens (max_position_embeddings)")


@register_engine("jax", JaxSamplerConfig, check=_check, shareable=False, processes="lockstep")
def _build(cfg: JaxSamplerConfig, ctx: EngineContext) -> JaxSampler:
  """The embedded sampler on the learner's own arrays; prompt room sized from the run's prompts
  (the model's context bounds it further: JaxSampler._check)."""
  cfg = dataclasses.replace(cfg, max_prompt_len=max(cfg.max_prompt_len, 2 * ctx.max_prompt_len),
                            pad_id=ctx.pad_id)
  return JaxSampler(ctx.model, cfg)
