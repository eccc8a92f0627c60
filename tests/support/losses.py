"""Shared helpers for the loss tests: random sequences, layouts (one per row / packed /
micro-batched), and the invariance checks every loss must pass.

A `Seq` is one sequence's per-token data (prompt tokens have mask 0). `layout` places a list
of sequences into a TrainBatch, rows given explicitly, so the same sequences can be laid out
one per row or packed several per row; `to_bt` / `from_bt` move per-sequence arrays in and
out of that layout so values and gradients can be compared token by token.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from posttrain_jax.losses import CORRECTIONS, get_loss
from posttrain_jax.types import TrainBatch, np_batch

PAD_LOGP = np.nan   # what the learner's logp holds on padding: the losses must ignore it
N_SEQS = 6          # sequences in every random case
FLAT_LEN = 8        # row length of one-per-row layouts (random sequences are at most 8 long)
PACK_LEN = 14       # row length of packed layouts
PACK_ROWS = 5       # rows of packed layouts (padded with empty rows)


@dataclasses.dataclass
class Seq:
  mask: np.ndarray        # [L] 1 on sampled tokens
  logp: np.ndarray        # [L] learner log-prob (the differentiated input)
  old: np.ndarray         # [L] log π_old
  beh: np.ndarray         # [L] log μ (0 where mask is 0, as engines report)
  ref: np.ndarray         # [L] log π_ref
  teacher: np.ndarray     # [L] log T
  adv: float              # the sequence's advantage, broadcast to its tokens
  teacher_mask: Optional[np.ndarray] = None   # [L] 1 where a teacher scored; None = all ones

  def __post_init__(self):
    if self.teacher_mask is None:
      self.teacher_mask = np.ones(len(self.mask))

  def __len__(self):
    return len(self.mask)


def random_seqs(rng: np.random.Generator, n: int = N_SEQS, *, min_len: int = 2, max_len: int = 6,
                max_prompt: int = 2, spread: float = 0.3) -> list[Seq]:
  """n sequences with ratios spread around 1 so clips and masks trigger on some tokens."""
  seqs = []
  for _ in range(n):
    prompt, comp = int(rng.integers(0, max_prompt + 1)), int(rng.integers(min_len, max_len + 1))
    length = prompt + comp
    mask = np.r_[np.zeros(prompt), np.ones(comp)]
    logp = -np.abs(rng.normal(0.0, 1.0, length)) - 0.05
    old = logp + rng.normal(0.0, spread, length)
    beh = np.where(mask > 0, old + rng.normal(0.0, spread, length), 0.0)
    ref = logp + rng.normal(0.0, spread, length)
    teacher = logp + rng.normal(0.0, 1.0, length)
    seqs.append(Seq(mask, logp, old, beh, ref, teacher, float(rng.normal())))
  return seqs


def one_per_row(seqs: Sequence[Seq]) -> list[list[int]]:
  return [[i] for i in range(len(seqs))]


def pack_rows(seqs: Sequence[Seq], row_len: int) -> list[list[int]]:
  """First-fit packing of sequences into rows of `row_len` tokens."""
  rows, used = [], []
  for i, s in enumerate(seqs):
    for r, u in enumerate(used):
      if u + len(s) <= row_len:
        rows[r].append(i)
        used[r] += len(s)
        break
    else:
      rows.append([i])
      used.append(len(s))
  return rows


@dataclasses.dataclass
class Layout:
  batch: TrainBatch
  where: list[tuple[int, int]]    # (row, start) of each sequence
  shape: tuple[int, int]


def layout(seqs: Sequence[Seq], rows: list[list[int]], row_len: Optional[int] = None, *,
           extra_seq_slots: int = 0, num_rows: Optional[int] = None,
           fields: Sequence[str] = ("old", "beh", "ref", "teacher"), dtype=np.float32) -> Layout:
  """Places `seqs` in rows; seq_ids are indices into `seqs`; padding is all zeros.

  `extra_seq_slots` adds absent sequences (seq_valid 0) to test a static S larger than needed;
  `num_rows` pads with empty rows. Fields not in `fields` are None in the batch; "teacher_mask"
  (Seq.teacher_mask, 0 on padding) is one of them, not in the default.
  """
  # Fixed default shapes let tests share compiled computations (the suite must stay fast).
  row_len = row_len or max(FLAT_LEN, max(sum(len(seqs[i]) for i in r) for r in rows))
  b = num_rows or len(rows)
  assert b >= len(rows)
  arr = lambda: np.zeros((b, row_len), dtype)
  ints = lambda: np.zeros((b, row_len), np.int32)
  mask, adv, old, beh, ref, teacher, tmask = arr(), arr(), arr(), arr(), arr(), arr(), arr()
  pos, seg, sid, tok = ints(), ints(), ints(), ints()
  where = [None] * len(seqs)
  for r, idx in enumerate(rows):
    start = 0
    for k, i in enumerate(idx):
      s, sl = seqs[i], slice(start, start + len(seqs[i]))
      assert start + len(s) <= row_len, "row too short"
      mask[r, sl], adv[r, sl] = s.mask, s.adv
      old[r, sl], beh[r, sl], ref[r, sl], teacher[r, sl] = s.old, s.beh, s.ref, s.teacher
      tmask[r, sl] = s.teacher_mask
      pos[r, sl], seg[r, sl], sid[r, sl] = np.arange(len(s)), k + 1, i
      tok[r, sl] = np.arange(len(s)) % 7 + 1
      where[i] = (r, start)
      start += len(s)
  seq_valid = np.r_[np.ones(len(seqs)), np.zeros(extra_seq_slots)]
  opt = {"old_logp": old, "behaviour_logp": beh, "ref_logp": ref, "teacher_logp": teacher,
         "teacher_mask": tmask}
  names = {"old": "old_logp", "beh": "behaviour_logp", "ref": "ref_logp", "teacher": "teacher_logp",
           "teacher_mask": "teacher_mask"}
  chosen = {names[f] for f in fields}
  batch = np_batch(input_ids=tok, target_ids=tok, loss_mask=mask, positions=pos, segment_ids=seg,
                   seq_ids=sid, seq_valid=seq_valid, advantages=adv,
                   **{k: (v if k in chosen else None) for k, v in opt.items()})
  if dtype == np.float64:   # np_batch casts to float32; keep float64 for x64 references
    floats = {"loss_mask": mask, "advantages": adv, "seq_valid": seq_valid,
              **{k: v for k, v in opt.items() if k in chosen}}
    batch = dataclasses.replace(batch,
                                **{k: jnp.asarray(v, jnp.float64) for k, v in floats.items()})
  return Layout(batch, where, (b, row_len))


def to_bt(lay: Layout, per_seq: Sequence[np.ndarray], fill=PAD_LOGP, dtype=np.float32):
  out = np.full(lay.shape, fill, dtype)
  for (r, start), x in zip(lay.where, per_seq):
    out[r, start:start + len(x)] = x
  return out


def from_bt(lay: Layout, x_bt, seqs: Sequence[Seq]) -> list[np.ndarray]:
  x_bt = np.asarray(x_bt)
  return [x_bt[r, start:start + len(s)] for (r, start), s in zip(lay.where, seqs)]


# Eager on purpose: with the fixed shapes above, op-by-op dispatch reuses compiled primitives
# across every test and config, which is ~2x faster on CPU than one jit compile per case.
def _value_and_grad(logp_bt, batch, name, cfg):
  fn = get_loss(name).fn
  return jax.value_and_grad(lambda lp: fn(lp, batch, cfg), has_aux=True)(logp_bt)


def loss_value_and_grad(name: str, cfg, lay: Layout, logp_bt):
  """(loss, metrics, d loss / d logp_bt) of a registered loss."""
  (loss, metrics), grad = _value_and_grad(jnp.asarray(logp_bt), lay.batch, name, cfg)
  return loss, metrics, grad


def _assert_same(a, b, rtol, atol, what):
  (l1, m1, g1), (l2, m2, g2) = a, b
  np.testing.assert_allclose(l1, l2, rtol=rtol, atol=atol, err_msg=what)
  for k in m1:
    if k.endswith(("_min", "_max")) and what == "microbatched":
      continue   # extremes are not sums (documented in losses/off_policy.py)
    np.testing.assert_allclose(np.asarray(m1[k]), np.asarray(m2[k]), rtol=rtol, atol=atol,
                               err_msg=f"{what}: metric {k}")
  for x, y in zip(g1, g2):
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=f"{what}: gradient")


def check_invariances(name, cfg, seqs, split: int = 3, row_len: int = PACK_LEN, *,
                      fields=("old", "beh", "ref", "teacher"), microbatch: bool = True,
                      rtol=1e-5, atol=1e-6):
  """packed == unpacked and micro-batched == full: loss, metrics, per-token gradient.

  Unpacked: one sequence per row. Packed: first-fit into rows of `row_len`, plus two absent
  sequence slots (seq_valid 0). Micro-batched: seqs[:split] and seqs[split:] each packed into
  the packed layout's shape (one compile), combined as Σ_k loss_k·count_k / Σ_k count_k (and
  the same for gradients and every (sum, count) metric).
  """
  rows = pack_rows(seqs, row_len)
  slots = len(seqs) + 2
  flat = layout(seqs, one_per_row(seqs), fields=fields)
  assert len(rows) < len(seqs), "the packed layout should really pack"
  packed = layout(seqs, rows, row_len, num_rows=max(PACK_ROWS, len(rows)), extra_seq_slots=2,
                  fields=fields)

  def run(lay, part):
    loss, metrics, grad = loss_value_and_grad(name, cfg, lay, to_bt(lay, [s.logp for s in part]))
    assert np.all(np.isfinite(np.asarray(grad))), "padding leaked into the gradient"
    return float(loss), {k: (float(a), float(b)) for k, (a, b) in metrics.items()}, \
        from_bt(lay, grad, part)

  full = run(flat, seqs)
  assert any(np.abs(g).max() > 0 for g in full[2]), "a zero gradient checks nothing"
  _assert_same(full, run(packed, seqs), rtol, atol, "packed")
  if not microbatch:
    return
  acc_loss = acc_count = 0.0
  acc_grads, acc_metrics = [], {}
  for part in (seqs[:split], seqs[split:]):
    part_rows = pack_rows(part, row_len)
    lay = layout(part, part_rows, row_len, num_rows=max(packed.shape[0], len(part_rows)),
                 extra_seq_slots=slots - len(part), fields=fields)
    l_k, m_k, g_k = run(lay, part)
    count = m_k["loss"][1]
    acc_loss += l_k * count
    acc_count += count
    acc_grads += [g * count for g in g_k]
    for k, (sm, c) in m_k.items():
      s0, c0 = acc_metrics.get(k, (0.0, 0.0))
      acc_metrics[k] = (s0 + sm, c0 + c)
  combined = (acc_loss / acc_count, acc_metrics, [g / acc_count for g in acc_grads])
  _assert_same(combined, full, rtol, atol, "microbatched")


def _separable_outputs(logp_bt, batch, name, cfg):
  spec = get_loss(name)
  terms = spec.token_terms(batch, cfg)
  l1, g1 = jax.value_and_grad(lambda lp: spec.fn(lp, batch, cfg)[0])(logp_bt)
  l2, g2 = jax.value_and_grad(lambda lp: jnp.sum(spec.token_loss(lp, terms, cfg)))(logp_bt)
  finite = jnp.where(jnp.isnan(logp_bt), 0.0, logp_bt)
  ell = lambda lp: spec.token_loss(lp.reshape(finite.shape), terms, cfg).ravel()
  jac = jax.jacfwd(ell)(finite.ravel())
  flat_terms = jax.tree_util.tree_map(lambda x: x.ravel(), terms)
  return l1, g1, l2, g2, jac, spec.token_loss(finite.ravel(), flat_terms, cfg), ell(finite.ravel())


def check_separable(name, cfg, seqs: Sequence[Seq], *,
                    fields: Sequence[str] = ("old", "beh", "ref", "teacher"),
                    rtol=1e-10, atol=1e-13):
  """The separable form against the float64 NumPy reference of the loss, token_loss elementwise.

  Σ token_loss(logp, token_terms(batch)), the form whose gradient the fused kernel computes,
  and spec.fn are each compared with `ref_loss` (value and per-token gradient), in float64 on
  a packed layout (two rows, a spare sequence slot). Elementwise: the Jacobian of token_loss
  w.r.t. logp is diagonal (NaN padding replaced, as jacfwd pushes tangents through every
  position), and token_loss works on any shape. Fields not in `fields` are None in the batch;
  without "old" the reference is the on-policy loss (π_old = π_θ).
  """
  assert get_loss(name).separable
  ref_seqs = seqs if "old" in fields else [dataclasses.replace(s, old=s.logp.copy())
                                           for s in seqs]
  want, want_grad = ref_loss(name, cfg, ref_seqs)
  half = (len(seqs) + 1) // 2
  with jax.enable_x64(True):
    lay = layout(seqs, [list(range(half)), list(range(half, len(seqs)))], 3 * FLAT_LEN,
                 extra_seq_slots=1, fields=fields, dtype=np.float64)
    logp_bt = jnp.asarray(to_bt(lay, [s.logp for s in seqs], dtype=np.float64))
    l1, g1, l2, g2, jac, ell_flat, ell = _separable_outputs(logp_bt, lay.batch, name, cfg)
  for what, loss, grad in (("Σ token_loss", l2, g2), ("spec.fn", l1, g1)):
    np.testing.assert_allclose(float(loss), want, rtol=rtol, atol=atol, err_msg=what)
    for g, w in zip(from_bt(lay, grad, seqs), want_grad):
      np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"{what}: gradient")
  assert max(np.abs(w).max() for w in want_grad) > 0, "a zero gradient checks nothing"
  jac = np.asarray(jac)
  np.testing.assert_array_equal(jac - np.diag(np.diag(jac)), 0.0)
  np.testing.assert_allclose(ell_flat, ell, rtol=1e-12, atol=1e-15)   # any shape
  return float(l2)


# ---------------------------------------------------------------- float64 NumPy references
# Plain loops over sequences and tokens, written from REFERENCES.md, sharing no code with the
# library. Each returns the loss and the analytic gradient w.r.t. every sequence's logp.

def ref_agg_weights(seqs, aggregation, max_len=None) -> list[np.ndarray]:
  """Per-sequence, per-token aggregation weights w_t (0 on unsampled tokens)."""
  out = []
  total = sum(float(s.mask.sum()) for s in seqs)
  n_nonempty = sum(1 for s in seqs if s.mask.sum() > 0)
  for s in seqs:
    w = np.zeros(len(s))
    for t in range(len(s)):
      if s.mask[t] == 0:
        continue
      if aggregation == "token_mean":
        w[t] = 1.0 / total
      elif aggregation == "seq_mean_token_mean":
        w[t] = 1.0 / (s.mask.sum() * n_nonempty)
      elif aggregation == "seq_mean_token_sum_norm":
        w[t] = 1.0 / (len(seqs) * max_len)
      else:
        raise ValueError(aggregation)
    out.append(w)
  return out


def ref_kl(x: float, estimator: str) -> tuple[float, float]:
  """(k(x), d k / d logp) with x = log q − logp, so dx/dlogp = −1."""
  if estimator == "k1":
    return -x, 1.0
  if estimator == "k2":
    return 0.5 * x * x, -x
  if estimator == "k3":
    return np.exp(x) - 1.0 - x, 1.0 - np.exp(x)
  raise ValueError(estimator)


def ref_correction(seqs, name, **p) -> list[np.ndarray]:
  """Per-token correction weights c_t from ρ_t = exp(old − beh) (0 on unsampled tokens)."""
  rho = [np.where(s.mask > 0, np.exp(s.old - s.beh), 0.0) for s in seqs]
  out = []
  if name == "m2po_mask":
    d = [((s.old[t] - s.beh[t]) ** 2, i, t) for i, s in enumerate(seqs)
         for t in range(len(s)) if s.mask[t]]
    d.sort(key=lambda x: -x[0])
    dropped = set()
    remaining = [x[0] for x in d]
    k = 0
    while remaining and sum(remaining) / len(remaining) >= p.get("tau", 0.04):
      dropped.add((d[k][1], d[k][2]))
      remaining.pop(0)
      k += 1
    return [np.array([0.0 if (i, t) in dropped or not s.mask[t] else 1.0
                      for t in range(len(s))]) for i, s in enumerate(seqs)]
  for s, r in zip(seqs, rho):
    tok = [t for t in range(len(s)) if s.mask[t]]
    c = np.zeros(len(s))
    if name == "none":
      for t in tok:
        c[t] = 1.0
    elif name == "tis":
      for t in tok:
        c[t] = min(r[t], p.get("cap", 2.0))
    elif name == "seq_tis":
      prod = 1.0
      for t in tok:
        prod *= r[t]
      for t in tok:
        c[t] = min(prod, p.get("cap", 5.0))
    elif name in ("mis", "icepop"):
      lo, hi = p["low"], p["high"]
      veto = p.get("veto")
      vetoed = veto is not None and any(r[t] < veto for t in tok)
      for t in tok:
        c[t] = r[t] if (lo <= r[t] <= hi and not vetoed) else 0.0
    elif name == "geo_mask":
      geo = np.exp(sum(np.log(r[t]) for t in tok) / len(tok))
      for t in tok:
        c[t] = 1.0 if p.get("low", 0.99) <= geo <= p.get("high", 1.01) else 0.0
    elif name == "decoupled":
      cap = p.get("cap")
      for t in tok:
        c[t] = 0.0 if (cap is not None and r[t] > cap) else r[t]
    else:
      raise ValueError(name)
    out.append(c)
  return out


def ref_pg(seqs, kind, *, eps_low, eps_high, dual_clip_c=None, aggregation="token_mean",
           max_len=None, kl_coef=0.0, kl_estimator="k3", corr=None, ratio_base="old"):
  """grpo (PPO-clip) or cispo; returns (loss, [grad per seq])."""
  weights = ref_agg_weights(seqs, aggregation, max_len)
  loss, grads = 0.0, []
  for i, s in enumerate(seqs):
    g = np.zeros(len(s))
    for t in range(len(s)):
      if not s.mask[t]:
        continue
      lp, a = s.logp[t], s.adv
      base = s.old[t] if ratio_base == "old" else s.beh[t]
      r = np.exp(lp - base)
      r_clip = min(max(r, 1.0 - eps_low), 1.0 + eps_high)
      if kind == "grpo":
        unclipped, clipped = -a * r, -a * r_clip
        if unclipped >= clipped:
          ell, d = unclipped, -a * r
        else:
          ell, d = clipped, 0.0
        if dual_clip_c is not None and a < 0 and ell > -dual_clip_c * a:
          ell, d = -dual_clip_c * a, 0.0
      else:  # cispo: the clipped ratio is a constant
        ell, d = -a * r_clip * lp, -a * r_clip
      c = 1.0 if corr is None else corr[i][t]
      ell, d = c * ell, c * d
      if kl_coef:
        k, dk = ref_kl(s.ref[t] - lp, kl_estimator)
        ell, d = ell + kl_coef * k, d + kl_coef * dk
      loss += weights[i][t] * ell
      g[t] = weights[i][t] * d
    grads.append(g)
  return loss, grads


def ref_gspo(seqs, *, eps_low=3e-4, eps_high=4e-4, kl_coef=0.0, kl_estimator="k3"):
  """GSPO; returns (loss, [grad per seq])."""
  live = [s for s in seqs if s.mask.sum() > 0]
  n = len(live)
  loss, grads = 0.0, []
  for s in seqs:
    g = np.zeros(len(s))
    tok = [t for t in range(len(s)) if s.mask[t]]
    if tok:
      length = len(tok)
      ratio = np.exp(sum(s.logp[t] - s.old[t] for t in tok) / length)
      a = s.adv
      unclipped, clipped = -a * ratio, -a * min(max(ratio, 1 - eps_low), 1 + eps_high)
      if unclipped >= clipped:
        loss += unclipped / n
        for t in tok:
          g[t] += -a * ratio / length / n
      else:
        loss += clipped / n
      for t in tok:
        if kl_coef:
          k, dk = ref_kl(s.ref[t] - s.logp[t], kl_estimator)
          loss += kl_coef * k / length / n
          g[t] += kl_coef * dk / length / n
    grads.append(g)
  return loss, grads


def ref_m2po(seqs, *, tau=0.04, ratio_base="behaviour", aggregation="token_mean", max_len=None,
             kl_coef=0.0, kl_estimator="k3"):
  """M2PO, the paper's form: ℓ_t = −M_t·r_t·A (no clip), r_t = exp(logp − base); (loss, grads)."""
  keep = ref_correction(seqs, "m2po_mask", tau=tau)
  weights = ref_agg_weights(seqs, aggregation, max_len)
  loss, grads = 0.0, []
  for i, s in enumerate(seqs):
    g = np.zeros(len(s))
    for t in range(len(s)):
      if not s.mask[t]:
        continue
      base = s.beh[t] if ratio_base == "behaviour" else s.old[t]
      r = np.exp(s.logp[t] - base)
      ell, d = -keep[i][t] * r * s.adv, -keep[i][t] * r * s.adv
      if kl_coef:
        k, dk = ref_kl(s.ref[t] - s.logp[t], kl_estimator)
        ell, d = ell + kl_coef * k, d + kl_coef * dk
      loss += weights[i][t] * ell
      g[t] = weights[i][t] * d
    grads.append(g)
  return loss, grads


def ref_distill(seqs, *, coef=1.0, rl_coef=0.0, is_clip=2.0, aggregation="token_mean",
                max_len=None):
  """sampled_distill: ℓ_t = −ρ_t·A_t·logp_t with A_t = coef·m_t·(T_t − logp_t) + rl_coef·Â and
  ρ_t = min(exp(logp_t − beh_t), c) (1 without c), ρ and A constants; (loss, grads)."""
  weights = ref_agg_weights(seqs, aggregation, max_len)
  loss, grads = 0.0, []
  for wi, s in zip(weights, seqs):
    g = np.zeros(len(s))
    for t in range(len(s)):
      if not s.mask[t]:
        continue
      lp = s.logp[t]
      delta = (s.teacher[t] - lp) if s.teacher_mask[t] else 0.0
      a = coef * delta + rl_coef * s.adv
      rho = 1.0 if is_clip is None else min(np.exp(lp - s.beh[t]), is_clip)
      loss += wi[t] * -rho * a * lp
      g[t] = wi[t] * -rho * a
    grads.append(g)
  return loss, grads


def ref_loss(name, cfg, seqs):
  """The float64 reference of any separable registered loss under its library config.

  Only parameter values are read from `cfg` (and the correction's config); every formula is
  one of the loops above. Returns (loss, [grad per seq]).
  """
  if name == "sft":
    w = ref_agg_weights(seqs, cfg.aggregation, cfg.max_len)
    return sum(float(np.sum(-wi * s.logp * s.mask)) for wi, s in zip(w, seqs)), \
        [-wi for wi in w]
  if name == "kl":
    attr = {"ref": "ref", "teacher": "teacher", "old": "old", "behaviour": "beh"}[cfg.against]
    w = ref_agg_weights(seqs, cfg.aggregation, cfg.max_len)
    loss, grads = 0.0, []
    for wi, s in zip(w, seqs):
      g = np.zeros(len(s))
      for t in range(len(s)):
        if s.mask[t]:
          k, dk = ref_kl(getattr(s, attr)[t] - s.logp[t], cfg.resolved_estimator)
          loss += wi[t] * k
          g[t] = wi[t] * dk
      grads.append(g)
    return loss, grads
  kw = {k: v for k, v in dataclasses.asdict(cfg).items()
        if k not in ("correction", "correction_cfg")}
  if name == "m2po":
    return ref_m2po(seqs, **kw)
  if name == "sampled_distill":
    return ref_distill(seqs, **kw)
  if name in ("grpo", "cispo"):
    corr = None
    if cfg.correction != "none":
      params = (dataclasses.asdict(cfg.correction_cfg) if cfg.correction_cfg is not None
                else dataclasses.asdict(CORRECTIONS.get(cfg.correction).config_cls()))
      corr = ref_correction(seqs, cfg.correction, **params)
    return ref_pg(seqs, name, corr=corr, **kw)
  raise ValueError(f"no float64 reference for loss {name!r}")
