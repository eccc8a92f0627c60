"""LossSpec.needs: every registered loss reads the optional batch fields it declares, and
works without the others (the contract in losses/base.py)."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.losses import layout, loss_value_and_grad, one_per_row, random_seqs, to_bt
from posttrain_jax.losses import (LOSSES, CISPOConfig, DistillConfig, FullDistillConfig,
                                  GRPOConfig, GSPOConfig, KLConfig, LossSpec, M2POConfig, M2POMaskConfig, SFTConfig,
                                  get_loss, register_loss)
from posttrain_jax.losses.base import OPTIONAL_FIELDS

OLD, BEH, REF, TEA, TMASK = "old_logp", "behaviour_logp", "ref_logp", "teacher_logp", "teacher_mask"
SHORT = {OLD: "old", BEH: "beh", REF: "ref", TEA: "teacher",
         TMASK: "teacher_mask"}   # loss_testing.layout's names

# (loss, config, the fields it needs), written out by hand from each loss's formula.
CASES = [
    ("sft", SFTConfig(), set()),
    ("sft", SFTConfig(aggregation="seq_mean_token_mean"), set()),
    ("kl", KLConfig(), {REF}),
    ("kl", KLConfig(against="teacher"), {TEA}),
    ("kl", KLConfig(against="old", estimator="k2"), {OLD}),
    ("kl", KLConfig(against="behaviour"), {BEH}),
    ("grpo", GRPOConfig(), set()),
    ("grpo", GRPOConfig(kl_estimator="k1"), set()),        # k1 for the metric only
    ("grpo", GRPOConfig(kl_coef=0.1), {REF}),
    ("grpo", GRPOConfig(correction="tis"), {OLD, BEH}),
    ("grpo", GRPOConfig(kl_coef=0.1, kl_estimator="k2", correction="m2po_mask",
                        correction_cfg=M2POMaskConfig(tau=0.1)), {OLD, BEH, REF}),
    ("cispo", CISPOConfig(), set()),
    ("cispo", CISPOConfig(ratio_base="behaviour"), {BEH}),
    ("cispo", CISPOConfig(kl_coef=0.05, correction="icepop"), {OLD, BEH, REF}),
    ("gspo", GSPOConfig(eps_low=0.05, eps_high=0.05), set()),
    ("gspo", GSPOConfig(eps_low=0.05, eps_high=0.05, kl_coef=0.1), {REF}),
    ("m2po", M2POConfig(tau=0.1), {OLD, BEH}),
    ("m2po", M2POConfig(tau=0.1, ratio_base="old", kl_coef=0.1), {OLD, BEH, REF}),
    ("sampled_distill", DistillConfig(), {TEA, TMASK, BEH}),          # ρ = min(π_θ/μ, 2)
    ("sampled_distill", DistillConfig(is_clip=None), {TEA, TMASK}),   # no importance weight
    ("sampled_distill", DistillConfig(rl_coef=0.5, is_clip=1.5,
                                      aggregation="seq_mean_token_mean"), {TEA, TMASK, BEH}),
]


def test_every_registered_loss_has_cases():
  # head losses take hidden states, not log-probs: tests/losses/test_losses_full_distill.py covers them
  head = {n for n in LOSSES.names() if get_loss(n).head}
  assert head == {"full_distill"}
  assert {name for name, _, _ in CASES} == set(LOSSES.names()) - head
  assert OPTIONAL_FIELDS == {OLD, BEH, REF, TEA, TMASK, "teacher_hidden"}
  assert get_loss("full_distill").needs(FullDistillConfig()) == {TMASK, "teacher_hidden"}


def _run(name, cfg, seqs, needed):
  # teacher_hidden ([B, T, D]) is read only by head losses, which are tested elsewhere
  lay = layout(seqs, one_per_row(seqs), fields=[SHORT[f] for f in sorted(needed) if f in SHORT])
  return lay, loss_value_and_grad(name, cfg, lay, to_bt(lay, [s.logp for s in seqs]))


@pytest.mark.parametrize("name, cfg, want", CASES)
def test_needs_is_exactly_what_the_loss_reads(name, cfg, want):
  spec = get_loss(name)
  needed = spec.needs(cfg)
  assert isinstance(needed, frozenset) and needed == want
  seqs = random_seqs(np.random.default_rng(50), spread=0.3)
  # All fields given. A field outside `needs` may be read only as documented: old_logp by the
  # policy-gradient family (absent = on-policy), so it holds the on-policy value here.
  full_seqs = seqs if OLD in needed else [dataclasses.replace(s, old=s.logp.copy())
                                          for s in seqs]
  _, (loss_all, metrics_all, grad_all) = _run(name, cfg, full_seqs, OPTIONAL_FIELDS)
  lay, (loss, metrics, grad) = _run(name, cfg, seqs, needed)
  np.testing.assert_allclose(float(loss), float(loss_all), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.nan_to_num(np.asarray(grad)),
                             np.nan_to_num(np.asarray(grad_all)), rtol=1e-6, atol=1e-7)
  assert set(metrics) <= set(metrics_all)
  for k in metrics:
    np.testing.assert_allclose(np.asarray(metrics[k]), np.asarray(metrics_all[k]), rtol=1e-6,
                               atol=1e-7, err_msg=k)
  if spec.separable:   # the fused path's form works from the same fields
    terms = spec.token_terms(lay.batch, cfg)
    logp = jnp.asarray(to_bt(lay, [s.logp for s in seqs]))
    np.testing.assert_allclose(float(jnp.sum(spec.token_loss(logp, terms, cfg))), float(loss),
                               rtol=1e-6, atol=1e-7)
  # Every needed field is read: without it both paths raise, naming it.
  for field in sorted(needed):
    missing = dataclasses.replace(lay.batch, **{field: None})
    logp = jnp.asarray(to_bt(lay, [s.logp for s in seqs]))
    with pytest.raises(ValueError, match=f"batch.{field}"):
      spec.fn(logp, missing, cfg)
    if spec.separable:
      with pytest.raises(ValueError, match=f"batch.{field}"):
        spec.token_terms(missing, cfg)


def test_register_loss_checks_inputs():
  fn = lambda logp, batch, cfg: (jnp.sum(logp), {})
  with pytest.raises(ValueError, match="loss 'bad'.*'ref'.*valid.*ref_logp"):
    register_loss("bad", SFTConfig, inputs=("ref",))(fn)
  with pytest.raises(TypeError, match="loss 'bad'.*string 'ref_logp'"):
    register_loss("bad", SFTConfig, inputs="ref_logp")(fn)
  with pytest.raises(TypeError, match="inputs"):
    register_loss("bad", SFTConfig)(fn)   # every loss must declare its inputs
  assert "bad" not in LOSSES
  spec = LossSpec("dummy", fn, SFTConfig, inputs=lambda cfg: ["logits"])
  with pytest.raises(ValueError, match="loss 'dummy' declares inputs \\['logits'\\]"):
    spec.needs(SFTConfig())
  with pytest.raises(TypeError, match="loss 'sft' takes a SFTConfig, got GRPOConfig"):
    get_loss("sft").needs(GRPOConfig())
