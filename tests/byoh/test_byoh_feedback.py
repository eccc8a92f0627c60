"""Sessions with free-text feedback but no grade (`rl.traces.require`): which sessions a run
takes, advantage exactly 0 and no baseline move for the ungraded ones, their sampled tokens
scored by the teacher, the counts in the metrics, and the configs that cannot learn from them.
Recorded through the real proxy (the openai client as the harness, the embedded sampler)."""
import httpx
import numpy as np
import openai
import pytest

from posttrain_jax.advantages import AdvantageConfig, BaselineState, compute_advantages
from posttrain_jax.byoh.rebuild import rebuild_session
from posttrain_jax.byoh.store import StoreConfig, TraceStore
from posttrain_jax.byoh.trace_source import TraceRollouts, TraceSourceConfig
from posttrain_jax.engines.jax_sampler import JaxSampler, JaxSamplerConfig
from posttrain_jax.metrics import read_metrics
from posttrain_jax.models import hf_io
from posttrain_jax.run_config import run_config_from_dict
from posttrain_jax.run import Trainer
from tests.support import byoh as bt
from tests.support import envs as et

# session -> the feedback posted on it, in this order (grade: session-level; text: session-level
# unless "call": on its one call); n4 gets none
FEEDBACK = {"g0": {"grade": 1.0}, "g1": {"grade": 0.0}, "f2": {"text": "rule: reverse"},
            "f3": {"text": "too short", "call": True}, "b5": {"grade": 0.5, "text": "close"}}
SESSIONS = ("g0", "g1", "f2", "f3", "n4", "b5")
TAKEN = {"grade": ["g0", "g1", "b5"], "feedback": ["f2", "f3", "b5"],
         "either": ["g0", "g1", "f2", "f3", "b5"]}


@pytest.fixture(scope="module")
def db(tmp_path_factory):
  path = tmp_path_factory.mktemp("fb") / "traces.db"
  tok = et.tokenizer("hermes")
  sampler = JaxSampler(hf_io.load_hf_model(et.tiny_dir("hermes")),
                       JaxSamplerConfig(max_prompt_len=128, pad_id=tok.pad_token_id))
  with bt.running(sampler, path) as (url, _):
    call_ids = {}
    for k, s in enumerate(SESSIONS):
      client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                             default_headers={"X-Session-Id": s})
      r = client.chat.completions.create(
          model="posttrain_jax", messages=[{"role": "user", "content": f"Compute {k}+1."}],
          max_tokens=6, seed=k)
      call_ids[s] = r.id
    for s, fb in FEEDBACK.items():
      body = {k: v for k, v in fb.items() if k != "call"}
      where = f"/calls/{call_ids[s]}" if fb.get("call") else ""
      httpx.post(f"{url}/v1/sessions/{s}{where}/feedback", json=body).raise_for_status()
  return path


def _collect(db, require):
  store = TraceStore(StoreConfig(path=str(db)))
  source = TraceRollouts(TraceSourceConfig(store=StoreConfig(path=str(db)), require=require), 8,
                         store=store)
  tasks, trajs = source.collect(0)
  metrics = source.metrics()
  store.close()
  return tasks, trajs, metrics


@pytest.mark.parametrize("require", sorted(TAKEN))
def test_require_chooses_the_sessions_and_counts_the_ungraded(db, require):
  tasks, trajs, metrics = _collect(db, require)
  assert [t.id for t in tasks] == [f"default/{s}" for s in TAKEN[require]]  # oldest row first
  assert [t.task_id for t in trajs] == TAKEN[require]                     # one call: one sample
  grades = {s: FEEDBACK[s].get("grade") for s in TAKEN[require]}
  assert {t.task_id: t.reward for t in trajs} == grades
  assert {t.task_id: t.feedback for t in trajs} == {s: FEEDBACK[s].get("text")
                                                    for s in TAKEN[require]}
  assert metrics["traces/sessions"] == len(TAKEN[require])
  assert metrics["traces/ungraded"] == sum(g is None for g in grades.values())


def test_ungraded_sessions_get_advantage_zero_and_never_move_the_running_baseline(db):
  _, trajs, _ = _collect(db, "either")
  graded = [t for t in trajs if t.reward is not None]
  cfg = AdvantageConfig(estimator="running", baseline_rate=0.5)
  start = BaselineState({"g0": 0.2}, 0.4)   # an ungraded sample counted would move both
  with pytest.raises(ValueError, match="no reward"):
    compute_advantages(trajs, cfg, start)   # a loss without a teacher: refused
  res = compute_advantages(trajs, cfg, start, allow_ungraded=True)
  alone = compute_advantages(graded, cfg, start)
  got = dict(zip([t.task_id for t in trajs], res.advantages))
  assert got["f2"] == 0.0 and got["f3"] == 0.0                           # exactly, not ≈
  np.testing.assert_array_equal([got[t.task_id] for t in graded], alone.advantages)
  assert res.state == alone.state and "f2" not in res.state.task_means
  # the hand values: g0 1.0 − 0.2; g1 and b5 unseen, the global mean 0.4
  np.testing.assert_allclose(alone.advantages, [0.8, -0.4, 0.1], rtol=1e-6)
  assert res.stats["ungraded"] == 2 and res.stats["ungraded_frac"] == pytest.approx(2 / 5)
  assert res.stats["unseen_tasks"] == 2 and all(res.keep)


RL = {"mode": "traces", "steps": 1, "prompts_per_step": 8, "reference_kl": False,
      "advantage": {"estimator": "running"},
      "learner": {"loss": "sampled_distill", "optimizer": {"learning_rate": 1e-3}},
      "loss": {"coef": 1.0, "rl_coef": 0.5},
      "teacher": {"context": "feedback", "seq_len": 96},
      "rollout": {"max_tokens": 4},
      "batch": {"rows": 8, "seq_len": 64, "max_seqs": 8, "pack": False}}


def _config(tmp_path, db, **rl):
  return run_config_from_dict({
      "workdir": str(tmp_path / "run"), "seed": 0,
      "model": {"tiny": {"chat_format": "hermes", **et.SMALL}},
      "tasks": {"generator_config": {"max_digits": 1, "ops": "+", "allow_negative": False},
                "eval_fraction": 0.2, "eval_size": 4},
      "sft": {"steps": 0},
      "rl": {**RL, "traces": {"store": {"path": str(db)}, "require": "either"}, **rl},
      "eval": {"every_steps": 0, "samples_per_prompt": 1, "max_tokens": 4, "greedy": False},
      "checkpoint": {"every_steps": 0}})


def test_a_mixed_distillation_run_trains_feedback_only_sessions_through_the_teacher(tmp_path, db):
  """require='either' with sampled_distill (rl_coef 0.5): the teacher scores every sampled token
  of the sessions with text (f2, f3, b5) and none of the grade-only ones (g0, g1); the two
  ungraded sessions are counted and stay out of the reward and the baseline."""
  store = TraceStore(StoreConfig(path=str(db)))
  tokens = {}
  for s in TAKEN["either"]:
    samples, _ = rebuild_session(s, store.calls("default", s), store.feedback("default", s))
    tokens[s] = sum(sum(t.loss_mask) for t in samples)
  store.close()
  assert Trainer(_config(tmp_path, db), log=lambda *_: None).run() is not None
  (row,) = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "traces/sessions" in r]
  assert row["traces/sessions"] == 5 and row["traces/ungraded"] == 2
  assert row["filter/ungraded_frac"] == pytest.approx(2 / 5)
  assert row["skipped_update"] == 0.0 and row["tokens"] == sum(tokens.values())
  with_text = tokens["f2"] + tokens["f3"] + tokens["b5"]
  assert row["distill/teacher_token_frac"] == pytest.approx(with_text / sum(tokens.values()))
  assert row["distill/no_context_frac"] == pytest.approx(2 / 5)   # g0, g1: no text
  assert row["reward/mean"] == pytest.approx((1.0 + 0.0 + 0.5) / 3)
  # the graded sessions g0, g1, b5 moved the global baseline; a session never comes back, so no
  # per-session mean is kept (it would grow with every session in every checkpoint)
  assert row["baseline/tasks"] == 0 and 0.0 <= row["baseline/global_mean"] <= 1.0


def test_feedback_only_sessions_are_fully_scored_by_the_teacher(tmp_path, db):
  assert Trainer(_config(tmp_path, db, traces={"store": {"path": str(db)},
                                               "require": "feedback"},
                         loss={"coef": 1.0, "rl_coef": 0.0}), log=lambda *_: None).run()
  (row,) = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "traces/sessions" in r]
  assert row["traces/sessions"] == 3 and row["traces/ungraded"] == 2
  assert row["distill/teacher_token_frac"] == 1.0 and row["distill/no_context_frac"] == 0.0


@pytest.mark.parametrize("over, match", [
    ({"learner": {"loss": "grpo"}, "loss": None}, r"rl\.traces\.require='feedback'.*'grpo'"),
    ({"teacher": {"context": "reference"}}, r"rl\.traces\.require='feedback'.*reference"),
    ({"traces": {"require": "text"}}, r"TraceSourceConfig\.require.*'text'")])
def test_configs_that_cannot_learn_from_ungraded_sessions_are_refused(tmp_path, over, match):
  rl = {"traces": {"require": "feedback"}, **over}
  with pytest.raises(Exception, match=match):
    run_config_from_dict({"rl": {**RL, **rl}})
  run_config_from_dict({"rl": {**RL, "learner": {"loss": "grpo"}, "loss": None}})  # "grade": ok


def test_a_triage_set_restricts_the_sessions_taken(tmp_path, db):
  """launch/triage.py's sets are config inputs: `rl.traces.sessions=sets/feedback.jsonl` takes
  exactly the sessions with free text, whatever `require` would also allow."""
  from posttrain_jax.byoh import triage
  store = TraceStore(StoreConfig(path=str(db)))
  paths = triage.write_sets(triage.curated_sets(triage.store_features(store)), tmp_path)
  source = TraceRollouts(TraceSourceConfig(store=StoreConfig(path=str(db)), require="either",
                                           sessions=str(paths["feedback"])), 8, store=store)
  tasks, _ = source.collect(0)
  assert sorted(t.id for t in tasks) == ["default/b5", "default/f2", "default/f3"]
  with pytest.raises(triage.TriageError, match=r"nope.jsonl: no such session set"):
    TraceRollouts(TraceSourceConfig(store=StoreConfig(path=str(db)),
                                    sessions=str(tmp_path / "nope.jsonl")), 8, store=store)
  store.close()
