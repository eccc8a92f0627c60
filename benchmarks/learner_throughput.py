"""Learner throughput: tokens/s of `train_step` and its fraction of this machine's matmul peak.

Measured side by side in one run (these machines are noisy):
  peak      the best rate of a 4096^2 fp32 matmul (the machine's practical peak),
  learner   posttrain_jax's jitted train_step (model + fused LM-head kernel + loss + AdamW),
  plain     a plain-jnp transformer train step of the same shape (materialised logits, no
            packing masks, no sharding constraints): what "no framework overhead" looks like.

Default model: d=768, 8 layers, vocab 8192 (73.9M parameters; the LM head is 11% of FLOPs,
about where 0.5-8B models sit). `--hidden 512 --vocab 32768` gives a head-heavy 61M model.

Model FLOPs per token = 6 * (non-embedding matmul params + LM head) + 12 * layers * T * d_attn
(forward + backward; the attention term counts QK^T and PV). fraction = achieved / peak.

    python benchmarks/learner_throughput.py --out /tmp/learner.json [--smoke]
ends with `RESULT tokens_per_s=... peak_fraction=...`. `--smoke`: the same steps at the smallest
size (d=64, 1 layer, vocab 256, 2 x 32 tokens, a 512^2 matmul peak, 1 repeat): seconds, for CI;
its figures are not headline figures.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from posttrain_jax import batching
from posttrain_jax import learner as L
from posttrain_jax.models import hf_io
from posttrain_jax.models.config import ModelConfig
from posttrain_jax.types import Trajectory

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))
from benchmarks._meta import run_info, write_result  # noqa: E402


def _best(fn, *args, repeats=5):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return min(times), float(np.median(times))


def matmul_peak(n=4096):
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  best, _ = _best(jax.jit(jnp.dot), a, b)
  return 2 * n**3 / best


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  d, f, h, kv, hd = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                     cfg.head_dim)
  per_layer = d * h * hd * 2 + d * kv * hd * 2 + 3 * d * f
  matmul_params = cfg.num_layers * per_layer + d * cfg.vocab_size  # + LM head
  attn = 12 * cfg.num_layers * seq_len * h * hd / 2  # causal: half the score matrix on average
  return 6 * matmul_params + attn


def plain_train_step(cfg: ModelConfig, batch: int, seq_len: int):
  """A minimal jnp transformer train step of the same shape (the baseline)."""
  d, f, h, hd, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.head_dim, cfg.vocab_size
  k = iter(jax.random.split(jax.random.key(0), 8 * cfg.num_layers + 4))
  init = lambda *s: 0.02 * jax.random.normal(next(k), s, jnp.float32)
  params = {"emb": init(v, d), "head": init(d, v),
            "layers": [{"qkv": init(d, 3 * h * hd), "o": init(h * hd, d), "up": init(d, 2 * f),
                        "down": init(f, d)} for _ in range(cfg.num_layers)]}
  tx = optax.adamw(1e-4)
  opt = tx.init(params)
  mask = jnp.tril(jnp.ones((seq_len, seq_len), bool))

  def norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)

  def loss_fn(p, ids):
    x = p["emb"][ids]
    for lp in p["layers"]:
      q, kk, vv = jnp.split(norm(x) @ lp["qkv"], 3, -1)
      q, kk, vv = (t.reshape(batch, seq_len, h, hd) for t in (q, kk, vv))
      s = jnp.einsum("bthd,bshd->bhts", q, kk) / np.sqrt(hd)
      a = jax.nn.softmax(jnp.where(mask, s, -1e30), -1)
      x = x + jnp.einsum("bhts,bshd->bthd", a, vv).reshape(batch, seq_len, h * hd) @ lp["o"]
      g, u = jnp.split(norm(x) @ lp["up"], 2, -1)
      x = x + (jax.nn.silu(g) * u) @ lp["down"]
    logits = norm(x) @ p["head"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp[:, :-1], ids[:, 1:, None], -1))

  @jax.jit
  def step(p, o, ids):
    loss, g = jax.value_and_grad(loss_fn)(p, ids)
    upd, o = tx.update(g, o, p)
    return optax.apply_updates(p, upd), o, loss

  ids = jax.random.randint(jax.random.key(1), (batch, seq_len), 0, v)
  return lambda: step(params, opt, ids)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True, help="write the figures here (JSON)")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq-len", type=int, default=256)
  ap.add_argument("--hidden", type=int, default=768)
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--vocab", type=int, default=8192)
  ap.add_argument("--loss", default="sft", help="a registered loss (sft, grpo, ...)")
  ap.add_argument("--micro_batches", type=int, default=1,
                  help="LearnerConfig.micro_batches (must divide --batch); the layout on a "
                       "sharded mesh is compared in benchmarks/micro_batch_layout.py")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--smoke", action="store_true",
                  help="the smallest size (d=64, 1 layer, vocab 256, 2 x 32 tokens, 512^2 peak "
                       "matmul, 1 repeat): seconds, for CI")
  args = ap.parse_args()
  info = run_info(smoke=args.smoke)
  peak_n = 4096
  if args.smoke:
    args.seq_len, args.hidden, args.layers, args.vocab, args.repeats = 32, 64, 1, 256, 1
    args.batch, peak_n = max(2, args.micro_batches), 512

  cfg = ModelConfig(family="llama", vocab_size=args.vocab, hidden_size=args.hidden,
                    intermediate_size=3 * args.hidden, num_layers=args.layers,
                    num_heads=args.hidden // 64, num_kv_heads=args.hidden // 64, head_dim=64,
                    tie_word_embeddings=False)
  b, t = args.batch, args.seq_len
  rng = np.random.default_rng(0)
  trajs = [Trajectory(id=str(i), task_id=str(i), token_ids=rng.integers(0, cfg.vocab_size, t + 1).tolist(),
                      loss_mask=[0] * 16 + [1] * (t + 1 - 16),
                      behaviour_logprobs=[0.0] * 16 + (-rng.random(t + 1 - 16)).tolist(),
                      policy_version=[0] * (t + 1)) for i in range(b)]
  batch = batching.build_batch(trajs, rng.normal(size=b).tolist(),
                               batching.BatchConfig(rows=b, seq_len=t, max_seqs=b, pack=False))

  peak = matmul_peak(peak_n)
  lcfg = L.LearnerConfig(loss=args.loss, micro_batches=args.micro_batches)
  learner = L.Learner(hf_io.init_model(cfg, 0), lcfg)
  put = learner.put_batch(batch)
  step = lambda: learner._step(learner.state, put)  # state is donated only when consumed below

  def run_learner():
    learner.state, m = step()
    return m["loss"]

  l_best, l_med = _best(lambda: run_learner(), repeats=args.repeats)
  p_fn = plain_train_step(cfg, b, t)
  p_best, p_med = _best(lambda: p_fn()[2], repeats=args.repeats)
  # measured before and after: a noisy neighbour only lowers it
  peak = max(peak, matmul_peak(peak_n))

  tokens = b * t
  flops = model_flops_per_token(cfg, t) * tokens
  rows = {
      "learner": {"step_s": l_best, "step_s_median": l_med, "tokens_per_s": tokens / l_best,
                  "flops_per_s": flops / l_best, "peak_fraction": flops / l_best / peak},
      "plain_jnp": {"step_s": p_best, "step_s_median": p_med, "tokens_per_s": tokens / p_best,
                    "flops_per_s": flops / p_best, "peak_fraction": flops / p_best / peak},
  }
  print(f"model: {cfg.num_params() / 1e6:.1f}M params, batch {b} x {t} tokens, loss {args.loss}; "
        f"{args.micro_batches} micro-batch(es); matmul peak {peak / 1e9:.1f} GFLOP/s "
        f"({peak_n}^2 fp32)")
  print(f"{'':<10} {'step s':>8} {'tokens/s':>10} {'GFLOP/s':>9} {'of peak':>8}")
  for name, r in rows.items():
    print(f"{name:<10} {r['step_s']:>8.3f} {r['tokens_per_s']:>10.0f} "
          f"{r['flops_per_s'] / 1e9:>9.1f} {r['peak_fraction']:>8.2f}")
  print(f"learner / plain time ratio: {l_best / p_best:.2f}")
  out = {"params": cfg.num_params(), "batch": b, "seq_len": t, "loss": args.loss,
         "micro_batches": args.micro_batches, "matmul_peak_flops": peak, **rows}
  write_result(args.out, info, out)
  r = rows["learner"]
  print(f"RESULT tokens_per_s={r['tokens_per_s']:.1f} peak_fraction={r['peak_fraction']:.3f}")


if __name__ == "__main__":
  main()
