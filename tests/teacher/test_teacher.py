"""teacher.py: the self-teacher's sequences, its log-probs against HF transformers, the
token-by-token alignment (a shifted one must fail), contexts, masks and the EMA."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.support.hf import VOCAB, save_random_hf_model
from posttrain_jax import batching
from posttrain_jax.learner import Learner, LearnerConfig
from posttrain_jax.losses import DistillConfig
from posttrain_jax.models import hf_io
from posttrain_jax.teacher import (AlignmentError, SelfTeacher, TeacherConfig, TeacherStart, align,
                                   ema_update,
                                   teacher_messages, teacher_trajectory)
from posttrain_jax.types import Trajectory
from tests.support.teacher import hf_token_logprobs, make_traj, encode




@pytest.fixture(scope="module")
def models(tmp_path_factory):
  path = tmp_path_factory.mktemp("hf")
  torch_model = save_random_hf_model("qwen3", path, seed=3)
  learner = Learner(hf_io.load_hf_model(path), LearnerConfig(loss="sampled_distill"),
                    DistillConfig(is_clip=None))
  return torch_model, learner






def test_teacher_messages_add_the_context_to_the_last_user_turn_of_the_prompt():
  msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
          {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a"},
          {"role": "user", "content": "later"}]
  out = teacher_messages(msgs, "CTX", "{prompt} / {context}")
  assert out == [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
                 {"role": "user", "content": "q2 / CTX"}]
  assert msgs[2]["content"] == "q2"                      # the trajectory's messages untouched
  assert teacher_messages([{"role": "system", "content": "s"}], "CTX", "{prompt}{context}") is None


def test_teacher_logprobs_equal_hf_on_the_teacher_sequence_and_only_where_there_is_context(models):
  torch_model, learner = models
  rng = np.random.default_rng(0)
  trajs = [make_traj(0, "abc", "rule: reverse", rng), make_traj(1, "hello", None, rng),
           make_traj(2, "xy", "too long", rng, tail=False)]
  cfg = TeacherConfig(context="feedback", template="{prompt}\n{context}", seq_len=96)
  student_cfg = batching.BatchConfig(rows=2, seq_len=128, max_seqs=4, pack=True)
  batch = batching.build_batch(trajs, [0.0] * 3, student_cfg)
  out, metrics = SelfTeacher(cfg, encode, student_cfg).fill(learner, trajs, batch)
  assert metrics["distill/no_context_frac"] == pytest.approx(1 / 3)
  sid, mask = np.asarray(batch.seq_ids), np.asarray(batch.loss_mask) > 0
  for s, traj in enumerate(trajs):
    here = (sid == s) & mask
    got_mask = np.asarray(out.teacher_mask)[here]
    if traj.feedback is None:
      assert not got_mask.any() and not np.asarray(out.teacher_logp)[here].any()
      continue
    assert got_mask.all()
    msgs = teacher_messages(traj.messages, cfg.feedback_template.format(text=traj.feedback),
                            cfg.template)
    t_ids = encode(msgs) + traj.token_ids[traj.prompt_len:]
    t_mask = [0] * len(encode(msgs)) + traj.loss_mask[traj.prompt_len:]
    want = hf_token_logprobs(torch_model, t_ids)[np.asarray(t_mask[1:]) > 0]
    np.testing.assert_allclose(np.asarray(out.teacher_logp)[here], want, rtol=1e-4, atol=1e-4)
    student = hf_token_logprobs(torch_model, traj.token_ids)[np.asarray(traj.loss_mask[1:]) > 0]
    assert np.max(np.abs(student - want)) > 1e-3       # the context changes the scores
  assert not np.asarray(out.teacher_mask)[~mask].any()  # never on prompt, tool result, padding


def test_a_shifted_or_edited_teacher_span_is_refused(models):
  _, learner = models
  rng = np.random.default_rng(1)
  trajs = [make_traj(0, "abc", "fb", rng), make_traj(1, "de", "fb", rng)]
  cfg = batching.BatchConfig(rows=2, seq_len=80, max_seqs=4, pack=False)
  student = batching.build_batch(trajs, [0.0, 0.0], cfg)
  prefix = encode([{"role": "user", "content": "with context"}])
  good = [teacher_trajectory(t, prefix) for t in trajs]
  logp = np.zeros((2, 80), np.float32)
  tb = batching.build_batch(good, [0.0, 0.0], cfg, with_behaviour=False)
  _, m, _ = align(student, tb, [0, 1], logp)
  assert m.sum() == sum(t.num_sampled for t in trajs)   # every sampled target aligned
  # shifted by one: the span copied from one token too early (same count, ids one off)
  t0, p = trajs[0], trajs[0].prompt_len
  ids = prefix + t0.token_ids[p - 1:]
  shifted = dataclasses.replace(good[0], token_ids=ids,
                                loss_mask=[0] * len(prefix) + t0.loss_mask[p:] + [0],
                                behaviour_logprobs=[0.0] * len(ids), policy_version=[0] * len(ids))
  tb = batching.build_batch([shifted, good[1]], [0.0, 0.0], cfg, with_behaviour=False)
  with pytest.raises(AlignmentError, match="t0.*sampled token"):
    align(student, tb, [0, 1], logp, [t.id for t in trajs])
  # one sampled id edited
  edited = dataclasses.replace(good[1], token_ids=good[1].token_ids[:-1]
                               + [(good[1].token_ids[-1] % (VOCAB - 2)) + 1])
  tb = batching.build_batch([good[0], edited], [0.0, 0.0], cfg, with_behaviour=False)
  with pytest.raises(AlignmentError, match="t1"):
    align(student, tb, [0, 1], logp, [t.id for t in trajs])
  # a sampled token dropped
  short = dataclasses.replace(good[1], loss_mask=good[1].loss_mask[:-1] + [0])
  tb = batching.build_batch([good[0], short], [0.0, 0.0], cfg, with_behaviour=False)
  with pytest.raises(AlignmentError, match="9 sampled tokens, its teacher sequence 8"):
    align(student, tb, [0, 1], logp, [t.id for t in trajs])


def test_sibling_and_sdpo_contexts():
  rng = np.random.default_rng(2)
  a, b, c = (make_traj(i, "q", None, rng) for i in range(3))
  a, b = dataclasses.replace(a, group_id="g"), dataclasses.replace(b, group_id="g", reward=1.0)
  b.messages[-1]["content"] = "the answer"
  c = dataclasses.replace(c, group_id="g2", feedback="wrong unit")
  cfg = TeacherConfig(context="sdpo")
  from posttrain_jax.teacher import CONTEXTS
  assert CONTEXTS.get("sdpo")(a, [a, b], None, cfg) == "A correct answer: the answer"
  assert CONTEXTS.get("sibling")(b, [a, b], None, cfg) is None        # not its own sibling
  assert CONTEXTS.get("sdpo")(c, [c], None, cfg) == "Feedback on an earlier attempt: wrong unit"
  assert CONTEXTS.get("feedback")(a, [a, b], None, cfg) is None


def test_ema_update_and_the_ema_teacher(models):
  _, learner = models
  t = {"w": jnp.array([1.0, 2.0]), "b": jnp.array(3.0)}
  p = {"w": jnp.array([3.0, -2.0]), "b": jnp.array(1.0)}
  out = ema_update(t, p, 0.25)
  np.testing.assert_allclose(out["w"], [1.5, 1.0])
  np.testing.assert_allclose(out["b"], 2.5)
  start = jax.tree.map(jnp.copy, learner.params)
  zeros = jax.tree.map(jnp.zeros_like, learner.params)

  def teacher(weights, restored=None, start_params=start, **cfg):
    ctx = TeacherStart(learner, lambda: start_params, lambda name: restored, None)
    return SelfTeacher.start(TeacherConfig(weights=weights, **cfg), encode,
                             batching.BatchConfig(), ctx)

  ema = teacher("ema", ema_rate=0.5)
  assert ema.params(learner) is start and ema.saved() == {"teacher": start}
  assert ema.step_inputs(learner) == {}              # sampled_distill is not a head loss
  assert teacher("ema", restored=zeros).params(learner) is zeros   # a resume continues the EMA
  moving = teacher("ema", start_params=zeros, ema_rate=0.25)
  moving.after_update(learner)                       # 0 + 0.25 (θ − 0)
  for got, want in zip(jax.tree.leaves(moving.params(learner)), jax.tree.leaves(learner.params)):
    np.testing.assert_allclose(np.asarray(got), 0.25 * np.asarray(want), rtol=1e-6)
  frozen = teacher("frozen", start_params=zeros)
  frozen.after_update(learner)
  assert all(not np.asarray(x).any() for x in jax.tree.leaves(frozen.params(learner)))
  assert frozen.saved() == {}                        # re-read from the start weights on resume
  student = teacher("student")
  assert student.params(learner) is learner.params and student.saved() == {}


@pytest.mark.parametrize("bad, match", [
    (dict(context="nope"), "teacher context"), (dict(weights="old"), "weights"),
    (dict(ema_rate=0.0), "ema_rate"), (dict(template="{prompt}"), "template")])
def test_config_errors_name_the_field(bad, match):
  with pytest.raises((ValueError, KeyError), match=match):
    TeacherConfig(**bad)


def test_teacher_hidden_is_the_state_that_gave_each_aligned_log_prob(models):
  """log softmax(teacher_hidden @ W)[target] at each scored position == teacher_logp (itself
  checked against HF above): the hidden states sit at the aligned positions, token by token."""
  _, learner = models
  rng = np.random.default_rng(3)
  trajs = [make_traj(0, "abc", "fb one", rng), make_traj(1, "hello", None, rng), make_traj(2, "q", "x", rng)]
  cfg = TeacherConfig(seq_len=96)
  student_cfg = batching.BatchConfig(rows=2, seq_len=128, max_seqs=4, pack=True)
  batch = batching.build_batch(trajs, [0.0] * 3, student_cfg)
  teacher = SelfTeacher(cfg, encode, student_cfg)
  out, _ = teacher.fill(learner, trajs, batch,
                        needs={"teacher_logp", "teacher_mask", "teacher_hidden"})
  only_hidden, _ = teacher.fill(learner, trajs, batch, needs={"teacher_mask", "teacher_hidden"})
  assert only_hidden.teacher_logp is None
  np.testing.assert_array_equal(only_hidden.teacher_hidden, out.teacher_hidden)
  w, transposed = learner.model().head()
  w = np.asarray(w).T if transposed else np.asarray(w)
  m = np.asarray(out.teacher_mask) > 0
  z = np.asarray(out.teacher_hidden, np.float64)[m] @ w
  z -= z.max(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  tgt = np.asarray(batch.target_ids)[m]
  np.testing.assert_allclose(logp[np.arange(len(tgt)), tgt], np.asarray(out.teacher_logp)[m],
                             rtol=1e-4, atol=1e-4)
  assert not np.asarray(out.teacher_hidden)[~m].any()
