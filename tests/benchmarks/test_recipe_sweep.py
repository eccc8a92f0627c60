"""benchmarks/recipe_sweep.py: the table and the pick (fastest to the top target, else to the
next lower one; a run ending 0.1 below its start is 'collapsed') on scripted runs."""
import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _sweep():
  spec = importlib.util.spec_from_file_location("recipe_sweep", ROOT / "benchmarks" / "recipe_sweep.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


# (prompts, lr) -> curve of (step, train seconds, greedy accuracy); nobody reaches 0.7
_CURVES = {(8, 1e-4): [(0, 0.0, 0.3), (10, 4.0, 0.45), (20, 8.0, 0.52)],
           (8, 3e-4): [(0, 0.0, 0.3), (10, 4.0, 0.1), (20, 8.0, 0.0)],
           (16, 1e-4): [(0, 0.0, 0.3), (10, 6.0, 0.51), (20, 12.0, 0.6)],
           (16, 3e-4): [(0, 0.0, 0.3), (10, 6.0, 0.35), (20, 12.0, 0.4)]}


def test_table_pick_and_collapse(tmp_path, monkeypatch, capsys):
  mod = _sweep()
  tta = mod.tta
  monkeypatch.setattr(tta, "warm_start", lambda *a, **k: (tmp_path / "warm", 0.3))

  def run_ours(warm, seed, args, work, recipe):
    curve = _CURVES[(recipe["prompts"], recipe["lr"])]
    hits = {t: next(((s, ts) for s, ts, a in curve if a >= t), None) for t in args.targets}
    return tta._summary("ours", seed, [1.0] + [0.1] * 20, curve, hits, curve[-1][1], 1.0,
                        completions=recipe["prompts"] * 8, recipe=recipe)
  monkeypatch.setattr(tta, "run_ours", run_ours)
  out = tmp_path / "s.json"
  mod.main(["--out", str(out), "--lrs", "1e-4,3e-4", "--prompts", "8,16", "--eps_highs", "0.2",
            "--work", str(tmp_path)])
  lines = capsys.readouterr().out.strip().splitlines()
  # 0.7 reached by none: the pick is the fastest to 0.5 (16x8 lr 1e-4 at 6 s, not 8x8 at 8 s)
  assert lines[-1] == ("RESULT best=16x8_lr0.0001_eps0.2 best_s_to_target=inf "
                       "best_s_to_lowest_target=6.0 runs=4 collapsed=1")
  table = {r["name"]: r for r in json.loads(out.read_text())["table"]}
  assert table["8x8_lr0.0003_eps0.2"]["collapsed"] == 1          # 0.3 -> 0.0
  assert table["16x8_lr0.0003_eps0.2"]["collapsed"] == 0         # 0.3 -> 0.4: slow, not collapsed
  assert table["8x8_lr0.0001_eps0.2"]["steps_to"]["0.5"] == 20
  assert any(l.startswith("8x8_lr0.0003_eps0.2") and l.endswith("collapsed") for l in lines)
